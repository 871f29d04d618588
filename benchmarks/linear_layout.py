"""Engine step time by batch size with the target's small-batch weight layout off and on (decoder/linear_layout.py).

Loads the pair once per layout (``off``, then ``auto`` as a replica would: timed at load, or ``transposed``
with ``--on transposed``), then per k and batch size B: B requests join one after another (ragged rows, as
in a served batch), and the median of ``--steps`` engine steps is taken. Reported, not asserted; prints
JSON (and writes ``--out``): step ms per (layout, k, B), the ratio on/off, what the layout chose at load.

    .venv/bin/python benchmarks/linear_layout.py --out results/linear_layout.json    # default pair, ~3 min
    .venv/bin/python benchmarks/linear_layout.py --pair tiny --steps 5               # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from decoder.engine import FSDEngine, SamplingParams  # noqa: E402
from decoder.linear_layout import SmallBatchLinear  # noqa: E402
from decoder.models import ModelPair  # noqa: E402
from decoder.pairs import load_pair  # noqa: E402


def _step_ms(pair: ModelPair, k: int, batch: int, steps: int) -> float:
    engine = FSDEngine(pair, num_draft_tokens=k, max_batch_size=max(batch, 1))
    prompt = pair.encode_prompt("Write a long story about a dragon who learns to code in Python.")
    params = SamplingParams(temperature=0.7, max_new_tokens=steps * (k + 1) + 64, eos_token_ids=())
    for r in range(batch):
        engine.add_request(f"r{r}", prompt, params, 0.0)
        engine.step()
        engine.step()
    timings = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        timings.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(timings)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--on", default="auto", choices=("auto", "transposed"), help="the layout compared with off")
    ap.add_argument("--ks", default="0,4", help="draft lengths (comma-separated)")
    ap.add_argument("--batches", default="1,2,3,4,8", help="batch sizes (comma-separated)")
    ap.add_argument("--steps", type=int, default=25, help="timed steps per point (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a replica's default: 1)")
    ap.add_argument("--out", default="results/linear_layout.json")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.steps < 1 or args.threads < 1 or min(ks) < 0 or min(batches) < 1:
        raise SystemExit(f"--steps and --threads must be >= 1, ks >= 0, batches >= 1; got {args.steps}, "
                         f"{args.threads}, {ks}, {batches}")
    torch.set_num_threads(args.threads)
    out: dict[str, object] = {
        "benchmark": "linear_layout", "pair": args.pair, "threads": args.threads, "steps": args.steps,
        "machine": f"{platform.machine()}; {os.cpu_count()} CPUs; {torch.backends.cpu.get_cpu_capability()}; "
                   f"torch {torch.__version__}; load average {os.getloadavg()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    step_ms: dict[str, dict[str, dict[str, float]]] = {}
    for layout in ("off", args.on):
        pair = load_pair(args.pair, linear_layout=layout)
        layers = [m for m in pair.target.modules() if isinstance(m, SmallBatchLinear)]
        out[f"{layout}_description"] = pair.description
        out[f"{layout}_max_rows"] = layers[0].max_rows if layers else 0
        step_ms[layout] = {
            f"k{k}": {f"B{b}": round(_step_ms(pair, k, b, args.steps), 1) for b in batches} for k in ks
        }
        del pair
    out["step_ms"] = step_ms
    out["ratio_on_off"] = {
        kk: {bb: round(step_ms[args.on][kk][bb] / step_ms["off"][kk][bb], 3) for bb in row}
        for kk, row in step_ms["off"].items()
    }
    emit(out, args.out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
