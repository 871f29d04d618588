"""The draft on its own KV cache against the draft on the target's (``FSDEngine(share_kv=...)``), same requests.

Per (T, k, batch) point both modes decode the same seeded requests (the demo's prompts, temperature 1, a fixed
number of tokens, no eos), alternating mode by repeat: acceptance rate (accepted / drafted), tokens per
second of the whole run (prefill included), the prefills' seconds, the draft's catch-up seconds and the mean
distortion per emitted token. Reported, not asserted; prints JSON (and writes ``--out``).

    .venv/bin/python benchmarks/shared_kv.py --out results/shared_kv.json     # default pair, ~3 min
    .venv/bin/python benchmarks/shared_kv.py --pair tiny --repeats 1         # smoke (the tiny pair opts in here)
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
from decoder.engine import FSDEngine, SamplingParams  # noqa: E402
from decoder.models import ModelPair  # noqa: E402
from decoder.pairs import load_pair  # noqa: E402
from sim.prompts import PROMPTS  # noqa: E402

POINTS = ((0.0, 4, 1), (0.0, 4, 4), (1.0, 4, 4), (4.0, 6, 4))  # (T, k, batch)


def run_point(pair: ModelPair, prompts: list[list[int]], share_kv: bool | None, threshold: float, k: int, batch: int,
              max_tokens: int, seed: int) -> dict[str, float]:
    engine = FSDEngine(pair, num_draft_tokens=k, max_batch_size=batch, seed=seed, share_kv=share_kv)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, eos_token_ids=(), seed=seed * 1000 + i)
        engine.add_request(str(i), prompt, params, threshold)
    started = time.perf_counter()
    steps = engine.run_to_completion()
    wall = time.perf_counter() - started
    outs = [engine.output(str(i)) for i in range(len(prompts))]
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tokens": tokens,
        "accepted": sum(o.accepted for o in outs),
        "drafted": sum(o.drafted for o in outs),
        "distortion": sum(o.distortion for o in outs),
        "wall_s": wall,
        "prefill_s": sum(s.prefill_time_s for s in steps),
        "catch_up_s": sum(s.catch_up_time_s for s in steps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8, help="requests per run (the demo's prompts, cycled)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode and point (seeds 0..repeats-1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a serving replica's default: 1)")
    ap.add_argument("--out", default="results/shared_kv.json")
    args = ap.parse_args()
    if min(args.prompts, args.max_tokens, args.repeats, args.threads) < 1:
        raise SystemExit(f"--prompts, --max-tokens, --repeats and --threads must be >= 1, got {args.prompts}, "
                         f"{args.max_tokens}, {args.repeats}, {args.threads}")
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    prompts = [pair.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
    points = []
    with torch.inference_mode():
        for threshold, k, batch in POINTS:
            sums: dict[bool, dict[str, float]] = {False: {}, True: {}}
            for seed in range(args.repeats):
                for share_kv in (False, True) if seed % 2 == 0 else (True, False):
                    got = run_point(pair, prompts, share_kv, threshold, k, batch, args.max_tokens, seed)
                    for key, value in got.items():
                        sums[share_kv][key] = sums[share_kv].get(key, 0.0) + value
            row: dict[str, object] = {"threshold": threshold, "k": k, "batch": batch}
            for share_kv, s in sums.items():
                row["shared" if share_kv else "separate"] = {
                    "acceptance_rate": round(s["accepted"] / max(s["drafted"], 1.0), 4),
                    "tokens_per_s": round(s["tokens"] / s["wall_s"], 2),
                    "prefill_s": round(s["prefill_s"], 3),
                    "catch_up_s": round(s["catch_up_s"], 3),
                    "distortion_per_token": round(s["distortion"] / max(s["tokens"], 1.0), 4),
                }
            print(json.dumps(row), file=sys.stderr, flush=True)
            points.append(row)
    out = {
        "benchmark": "shared_kv",
        "pair": args.pair,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "torch_threads": args.threads,
        **host(),
        "points": points,
    }
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
