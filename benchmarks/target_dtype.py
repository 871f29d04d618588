"""The target's compute dtype (``model.dtype``): fp32 (the default pair's) against bf16, on the machine at hand.

On a CPU with AVX512-bf16 / AMX a bf16 forward is no faster than fp32 for one row (both read the weights once),
but much cheaper for several rows and for a (k+1)-token verify; on an AVX2-only CPU bf16 loses everywhere.
With a bf16 target the default pair's draft (an int8 copy computing in fp32) can no longer run on the target's
KV cache (``share_kv`` needs one dtype), so it keeps its own cache: lower acceptance, a draft prefill.

Per dtype and (T, k, batch) point the engine decodes the same seeded requests (``benchmarks/shared_kv.py``'s
``run_point``: the demo's prompts, temperature 1, a fixed number of tokens, no eos): tokens per second of the
whole run, acceptance rate, prefill seconds, distortion per token, and whether the draft shared the cache.
With ``--repeats`` above 1 the dtypes' order alternates by repeat. Reported, not asserted; prints JSON
(and writes ``--out``).

    .venv/bin/python benchmarks/target_dtype.py --out results/target_dtype.json   # default pair, ~3.5 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import emit, host  # noqa: E402
from benchmarks.shared_kv import run_point  # noqa: E402
from decoder.engine import default_share_kv  # noqa: E402
from decoder.pairs import load_pair  # noqa: E402
from sim.prompts import PROMPTS  # noqa: E402

#: (T, k, batch): plain decoding at 1 / 4 / 8 rows, lossless and fuzzy speculation at 1 and 4.
POINTS = ((0.0, 0, 1), (0.0, 0, 4), (0.0, 0, 8), (0.0, 4, 1), (0.0, 4, 4), (1.0, 4, 1), (1.0, 4, 4))


def cpu_features() -> dict[str, object]:
    """What decides whether bf16 pays: torch's kernel level and the bf16 / AMX units."""
    probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    out: dict[str, object] = {"capability": torch.backends.cpu.get_cpu_capability()}
    for name, probe in probes.items():
        fn = getattr(torch.cpu, probe, None)
        out[name] = bool(fn()) if fn is not None else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--dtypes", default="fp32,bf16", help="target dtypes to compare (comma-separated)")
    ap.add_argument("--prompts", type=int, default=8, help="requests per run (the demo's prompts, cycled)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1, help="runs per dtype and point (seeds 0..repeats-1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a serving replica's default: 1)")
    ap.add_argument("--out", default="results/target_dtype.json")
    args = ap.parse_args()
    if min(args.prompts, args.max_tokens, args.repeats, args.threads) < 1:
        raise SystemExit(f"--prompts, --max-tokens, --repeats and --threads must be >= 1, got {args.prompts}, "
                         f"{args.max_tokens}, {args.repeats}, {args.threads}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes:
        raise SystemExit(f"--dtypes names no dtype: {args.dtypes!r}")
    torch.set_num_threads(args.threads)
    pairs = {d: load_pair(args.pair, dtype=d) for d in dtypes}  # a bad dtype fails here, before any timing
    prompts = {d: [p.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)] for d, p in pairs.items()}
    started = time.perf_counter()
    points = []
    with torch.inference_mode():
        for threshold, k, batch in POINTS:
            sums: dict[str, dict[str, float]] = {d: {} for d in dtypes}
            for seed in range(args.repeats):
                for d in dtypes if seed % 2 == 0 else dtypes[::-1]:
                    got = run_point(pairs[d], prompts[d], None, threshold, k, batch, args.max_tokens, seed)
                    for key, value in got.items():
                        sums[d][key] = sums[d].get(key, 0.0) + value
            row: dict[str, object] = {"threshold": threshold, "k": k, "batch": batch}
            for d, s in sums.items():
                row[d] = {
                    "tokens_per_s": round(s["tokens"] / s["wall_s"], 2),
                    "acceptance_rate": round(s["accepted"] / s["drafted"], 4) if s["drafted"] else None,
                    "prefill_s": round(s["prefill_s"], 3),
                    "distortion_per_token": round(s["distortion"] / max(s["tokens"], 1.0), 4),
                    "share_kv": k > 0 and default_share_kv(pairs[d]),
                }
            print(json.dumps(row), file=sys.stderr, flush=True)
            points.append(row)
    out = {
        "benchmark": "target_dtype",
        "pair": args.pair,
        "dtypes": dtypes,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "torch_threads": args.threads,
        "cpu": cpu_features(),
        **host(),
        "wall_s": round(time.perf_counter() - started, 1),
        "points": points,
    }
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
