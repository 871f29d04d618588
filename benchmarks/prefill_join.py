"""Prefill of a request joining an idle engine against one joining a running batch (``FSDEngine``).

A join into a running batch extends the batch's KV cache; the simulator charges every join the prefill that
``fsd calibrate`` fits on prefills into an idle engine. Per draft length k and count of running rows, a fresh
engine decodes that many rows a few steps, then one request joins: the step's ``prefill_time_s`` (the join's
prefill alone), its wall time and its decode part, median over ``--repeats``. Reported, not asserted; prints
JSON (and writes ``--out``).

    .venv/bin/python benchmarks/prefill_join.py --out results/prefill_join.json     # default pair, ~2 min
    .venv/bin/python benchmarks/prefill_join.py --pair tiny --repeats 1              # smoke
"""

from __future__ import annotations

import argparse
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
from sim.prompts import PROMPTS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--running", default="0,1,2,4", help="rows decoding when the request joins (comma-separated)")
    ap.add_argument("--ks", default="0,4", help="draft lengths (comma-separated)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a serving replica's default: 1)")
    ap.add_argument("--out", default="results/prefill_join.json")
    args = ap.parse_args()
    try:
        running = [int(x) for x in args.running.split(",")]
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        raise SystemExit(f"--running and --ks take comma-separated integers, got {args.running!r}, {args.ks!r}") from None
    if min(running) < 0 or min(ks) < 0 or args.repeats < 1 or args.threads < 1:
        raise SystemExit(f"--running and --ks must be >= 0, --repeats and --threads >= 1; got {running}, {ks}, "
                         f"{args.repeats}, {args.threads}")
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    base = pair.encode_prompt(PROMPTS[0])
    joiner = pair.encode_prompt(PROMPTS[1])
    points = []
    with torch.inference_mode():
        for k in ks:
            for rows in running:
                samples = []
                for repeat in range(args.repeats):
                    engine = FSDEngine(pair, num_draft_tokens=k, max_batch_size=max(rows + 1, 1))
                    for b in range(rows):
                        engine.add_request(f"r{b}", base, SamplingParams(
                            temperature=1.0, max_new_tokens=400, seed=b, eos_token_ids=()))
                    for _ in range(6 if rows else 0):
                        engine.step()
                    engine.add_request("join", joiner, SamplingParams(
                        temperature=1.0, max_new_tokens=8, seed=100 + repeat, eos_token_ids=()))
                    started = time.perf_counter()
                    stats = engine.step()
                    wall = time.perf_counter() - started
                    samples.append((stats.prefill_time_s, wall, stats.draft_time_s + stats.verify_time_s))
                median = [round(1e3 * statistics.median(s[i] for s in samples), 1) for i in range(3)]
                row = {"k": k, "running": rows, "prefill_ms": median[0], "step_ms": median[1], "decode_ms": median[2]}
                print(row, file=sys.stderr, flush=True)
                points.append(row)
    emit({
        "benchmark": "prefill_join",
        "pair": args.pair,
        "join_prompt_tokens": len(joiner),
        "running_prompt_tokens": len(base),
        "repeats": args.repeats,
        "torch_threads": args.threads,
        **host(),
        "points": points,
    }, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
