"""The draft's catch-up: what a step costs when rows that ran at k = 0 start drafting, against the profile.

A request that joins at k = 0 skips the draft's prefill and its tokens stay unseen by the draft while it
decodes plainly; the first step at k > 0 runs the draft over every row's backlog (prompt + output so far)
in one left-padded forward. Per case: B requests of P filler tokens join at k = 0, decode N plain steps,
switch to k; the switching step and the median of the next steps are timed. ``extra_ms`` = switching step
− steady step; ``model_ms`` = the profile's ``draft_catch_up_ms(B × (P + N + 1))``. ``--share-kv both`` runs
every case with the draft on its own cache and on the target's (``FSDEngine(share_kv=...)``: no backlog to
catch up on), interleaved. Reported, not asserted; prints JSON (and writes ``--out``).

    .venv/bin/python benchmarks/draft_catch_up.py --out results/draft_catch_up.json    # default pair, ~2 min
    .venv/bin/python benchmarks/draft_catch_up.py --share-kv both --out results/draft_catch_up_shared.json
    .venv/bin/python benchmarks/draft_catch_up.py --pair tiny --profile <tiny profile>  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import emit, host  # noqa: E402
from decoder.engine import FSDEngine, SamplingParams  # noqa: E402
from decoder.pairs import load_pair  # noqa: E402
from sim.profile import Profile  # noqa: E402

CASES = ((128, 4, 24), (128, 2, 12), (40, 4, 24), (40, 8, 24))  # (prompt tokens, rows, plain steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--profile", default=None, help="profile JSON to compare with (default: the shipped one)")
    ap.add_argument("--k", type=int, default=6, help="the draft length switched to")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steady-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (calibration uses 1)")
    ap.add_argument("--share-kv", choices=("auto", "on", "off", "both"), default="off",
                    help="the draft on the target's KV cache: the pair's default, on, off (default: the catch-up "
                    "this measures exists only then), or both modes interleaved")
    ap.add_argument("--out", default="results/draft_catch_up.json")
    args = ap.parse_args()
    if args.k < 1 or args.repeats < 1 or args.steady_steps < 1 or args.threads < 1:
        raise SystemExit(f"--k, --repeats, --steady-steps and --threads must be >= 1, got {args.k}, {args.repeats}, "
                         f"{args.steady_steps}, {args.threads}")
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    latency = (Profile.load(args.profile) if args.profile else Profile.default()).latency
    mode_lists: dict[str, list[bool | None]] = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}
    modes = mode_lists[args.share_kv]
    rows = []
    for prompt_tokens, batch, plain_steps in CASES:
        prompt_tokens = min(prompt_tokens, pair.max_context // 2)
        for rep, share_kv in ((r, m) for r in range(args.repeats) for m in modes):
            engine = FSDEngine(pair, num_draft_tokens=0, div="kl", max_batch_size=batch, seed=rep, share_kv=share_kv)
            prompt = list(range(1000, 1000 + prompt_tokens))
            params = [SamplingParams(temperature=1.0, max_new_tokens=plain_steps + 4 * (args.k + 1) * args.steady_steps,
                                     eos_token_ids=(), seed=r) for r in range(batch)]
            for r in range(batch):
                engine.add_request(f"r{r}", prompt, params[r], 4.0)
            for _ in range(plain_steps + 1):  # the admission step, then plain steps
                engine.step()
            engine.set_draft_length(args.k)
            t0 = time.perf_counter()
            switching = engine.step()
            switch_ms = (time.perf_counter() - t0) * 1e3
            steady = []
            for _ in range(args.steady_steps):
                t0 = time.perf_counter()
                engine.step()
                steady.append((time.perf_counter() - t0) * 1e3)
            backlog = prompt_tokens + plain_steps + 1
            steady_ms = statistics.median(steady)
            rows.append({
                "prompt_tokens": prompt_tokens, "rows": batch, "backlog_per_row": backlog, "repeat": rep,
                "share_kv": engine.share_kv, "switching_catch_up_ms": round(switching.catch_up_time_s * 1e3, 1),
                "switching_step_ms": round(switch_ms, 1), "switching_draft_ms": round(switching.draft_time_s * 1e3, 1),
                "steady_step_ms": round(steady_ms, 1), "extra_ms": round(switch_ms - steady_ms, 1),
                "model_ms": round(latency.draft_catch_up_ms(batch * backlog), 1) if not engine.share_kv else 0.0,
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = {
        "benchmark": "draft_catch_up",
        "pair": args.pair,
        "k": args.k,
        "torch_threads": args.threads,
        **host(),
        "model": {"draft_prefill_fixed_ms": latency.draft_prefill_fixed_ms,
                  "draft_prefill_ms_per_token": latency.draft_prefill_ms_per_token},
        "cases": rows,
    }
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
