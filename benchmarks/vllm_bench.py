"""Native engine vs the vLLM backend on the default pair, one run: target alone, SD, FSD at a few T;
greedy and sampled; batch 1 and 8 — tokens/s, acceptance, fuzzy acceptance and distortion per token.

Both engines run the *same* models: SmolLM2-135M-Instruct fp32 (the dequantized GGUF of the default pair)
drafted by its first ``--draft-layers`` decoder layers (fsd_vllm.offline.truncated_draft; vLLM cannot load
the native pair's int8 dynamic draft). The native side runs here (project venv; target alone = the native
engine at k = 0, plain decoding); the vLLM side runs in ``.venv-vllm`` (``make vllm-env``) through
``python -m fsd_vllm.offline``, one engine start for k = 0 and one for k = ``--k``. ``agreement`` pairs
the two engines' fuzzy-acceptance rate and distortion per token at equal (batch, temperature, T) with a
binomial standard error on the pooled fuzzy rate: the cross-engine check of the FSD rule. Prints one JSON
document. Figures on a shared 2-core machine are noisy: compare ratios from one run.

    python benchmarks/vllm_bench.py --max-tokens 48 --batches 1 8 --temperatures 0 1 --thresholds 0.5 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from decoder.generate import generate  # noqa: E402
from decoder.pairs import load_pair  # noqa: E402
from fsd_vllm.offline import DEFAULT_PROMPTS, default_target_dir, truncated_draft  # noqa: E402

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _mode(k: int, threshold: float) -> str:
    return "target" if k == 0 else ("fsd" if threshold > 0 else "sd")


def native_runs(
    target: Path, draft: Path, k: int, batches: list[int], temperatures: list[float], thresholds: list[float],
    max_tokens: int,
) -> list[dict[str, Any]]:
    pair = load_pair(f"{target},{draft}", dtype="fp32", draft_dtype="fp32")
    rows = []
    for batch in batches:
        prompts = [pair.encode_prompt(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]) for i in range(batch)]
        for temperature in temperatures:
            for num_draft, threshold in [(0, 0.0), (k, 0.0), *((k, t) for t in thresholds)]:
                started = time.perf_counter()
                with torch.inference_mode():
                    out = generate(
                        pair.target, pair.draft, prompts, fsd_threshold=threshold, num_draft_tokens=num_draft,
                        do_sample=temperature > 0, temperature=temperature or 1.0, max_new_tokens=max_tokens,
                        eos_token_id=[], track_acceptance_metrics=True, max_batch_size=batch, seed=0,
                    )
                seconds = time.perf_counter() - started
                tokens = batch * max_tokens
                drafted = out.total_draft_tokens or 0
                rows.append({
                    "engine": "native", "mode": _mode(num_draft, threshold), "batch": batch,
                    "temperature": temperature, "threshold": threshold, "tokens": tokens,
                    "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
                    "drafted": drafted, "accepted": out.total_accepted_tokens or 0,
                    "fuzzy_accepted": out.fuzzy_accepted_tokens or 0,
                    "distortion_per_token": out.mean_distortion,
                })
    return rows


def vllm_runs(
    draft_layers: int, k: int, batches: list[int], temperatures: list[float], thresholds: list[float],
    max_tokens: int,
) -> list[dict[str, Any]]:
    rows = []
    for num_draft in (0, k):
        command = [
            str(VLLM_PYTHON), "-m", "fsd_vllm.offline", "--k", str(num_draft), "--draft-layers", str(draft_layers),
            "--batch", *map(str, batches), "--temperature", *map(str, temperatures),
            "--threshold", "0", *map(str, thresholds), "--max-tokens", str(max_tokens),
        ]
        env = {k_: v for k_, v in os.environ.items() if k_ not in ("PYTHONPATH", "VIRTUAL_ENV")}
        done = subprocess.run(command, capture_output=True, text=True, cwd="/tmp", env=env, check=False)
        lines = [x for x in done.stdout.splitlines() if x.startswith("FSD_VLLM_RUNS ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"vLLM run failed (rc={done.returncode}): {done.stderr[-3000:]}")
        for run in json.loads(lines[-1].removeprefix("FSD_VLLM_RUNS "))["runs"]:
            c = run["counters"]
            tokens = run["generated_tokens"]
            rows.append({
                "engine": "vllm", "mode": run["mode"], "batch": run["batch"], "temperature": run["temperature"],
                "threshold": run["threshold"], "tokens": tokens, "seconds": run["seconds"],
                "tokens_per_s": run["tokens_per_s"], "drafted": int(c.get("drafted", 0)),
                "accepted": int(c.get("accepted", 0)), "fuzzy_accepted": int(c.get("fuzzy_accepted", 0)),
                "distortion_per_token": float(c.get("distortion", 0.0)) / tokens if tokens else None,
                "engine_start_s": run["engine_start_s"],
            })
    return rows


def agreement(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Native vs vLLM at equal (batch, temperature, T > 0): fuzzy-acceptance rates with a binomial standard
    error of their difference (pooled rate), and distortion per token side by side."""
    by_key = {(r["engine"], r["batch"], r["temperature"], r["threshold"]): r for r in rows if r["mode"] != "target"}
    out = []
    for (engine, batch, temperature, threshold), native in sorted(by_key.items()):
        vllm = by_key.get(("vllm", batch, temperature, threshold))
        if engine != "native" or vllm is None or not native["drafted"] or not vllm["drafted"]:
            continue
        rate_n = native["fuzzy_accepted"] / native["drafted"]
        rate_v = vllm["fuzzy_accepted"] / vllm["drafted"]
        pooled = (native["fuzzy_accepted"] + vllm["fuzzy_accepted"]) / (native["drafted"] + vllm["drafted"])
        se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / native["drafted"] + 1 / vllm["drafted"]))
        out.append({
            "batch": batch, "temperature": temperature, "threshold": threshold,
            "acceptance_native": round(native["accepted"] / native["drafted"], 4),
            "acceptance_vllm": round(vllm["accepted"] / vllm["drafted"], 4),
            "fuzzy_rate_native": round(rate_n, 4), "fuzzy_rate_vllm": round(rate_v, 4),
            "fuzzy_rate_z": round((rate_n - rate_v) / se, 2),
            "distortion_per_token_native": native["distortion_per_token"],
            "distortion_per_token_vllm": vllm["distortion_per_token"],
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-layers", type=int, default=24)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 2.0], help="FSD T (kl) besides 0")
    parser.add_argument("--skip-native", action="store_true")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no vLLM environment at {VLLM_PYTHON.parent.parent}: run `make vllm-env`")
    if any(t <= 0 for t in args.thresholds):
        raise SystemExit(f"--thresholds are the FSD T values besides 0 (always run), got {args.thresholds}")
    # vLLM keeps one core for itself on this CPU build; the native side gets the same share.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    target = default_target_dir()
    if not (target / "config.json").exists():
        load_pair("smollm2-135m")  # dequantizes the GGUF into the cache once
    draft = truncated_draft(target, args.draft_layers)
    grid = (args.k, args.batches, args.temperatures, args.thresholds, args.max_tokens)
    rows = [] if args.skip_native else native_runs(target, draft, *grid)
    rows += vllm_runs(args.draft_layers, *grid)
    print(json.dumps({
        "command": " ".join(sys.argv),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads_native": torch.get_num_threads(),
        "pair": f"{target} drafted by its first {args.draft_layers} layers",
        "k": args.k, "div": "kl", "rule": "reducible", "max_tokens": args.max_tokens,
        "rows": rows,
        "agreement": agreement(rows),
    }, indent=1))


if __name__ == "__main__":
    main()
