"""Native engine vs the vLLM backend on the default pair, greedy, one run: target alone and SD, batch 1 and 8.

Both engines run the *same* models: SmolLM2-135M-Instruct fp32 (the dequantized GGUF of the default pair)
drafted by its first ``--draft-layers`` decoder layers (fsd_vllm.offline.truncated_draft; vLLM cannot load
the native pair's int8 dynamic draft). The native side runs here (project venv); the vLLM side runs in
``.venv-vllm`` (``make vllm-env``) through ``python -m fsd_vllm.offline``, one engine start per mode.
Prints one JSON document. Figures on a shared 2-core machine are noisy: compare ratios from one run.

    python benchmarks/vllm_bench.py --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
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
from decoder.models import load_pair  # noqa: E402
from fsd_vllm.offline import DEFAULT_PROMPTS, default_target_dir, truncated_draft  # noqa: E402

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def native_runs(target: Path, draft: Path, k: int, batches: list[int], max_tokens: int) -> list[dict[str, Any]]:
    """Target alone: HF ``generate`` of the target (the native engine always drafts, k >= 1); SD: the
    native FSD engine at T = 0 through ``decoder.generate``."""
    pair = load_pair(f"{target},{draft}", dtype="fp32", draft_dtype="fp32")
    rows = []
    for batch in batches:
        prompts = [pair.encode_prompt(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]) for i in range(batch)]
        width = max(len(p) for p in prompts)
        pad = pair.eos_token_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        for mode in ("target", "sd"):
            started = time.perf_counter()
            acceptance = None
            with torch.inference_mode():
                if mode == "target":
                    pair.target.generate(
                        input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                        do_sample=False, pad_token_id=pad,
                    )
                else:
                    out = generate(
                        pair.target, pair.draft, prompts, num_draft_tokens=k, max_new_tokens=max_tokens,
                        eos_token_id=[], track_acceptance_metrics=True, max_batch_size=batch,
                    )
                    acceptance = out.draft_token_acceptance_rate
            seconds = time.perf_counter() - started
            tokens = batch * max_tokens
            rows.append({
                "engine": "native", "mode": mode, "batch": batch, "tokens": tokens,
                "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
                "acceptance_rate": acceptance,
            })
    return rows


def vllm_runs(draft_layers: int, k: int, batches: list[int], max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for mode, num_draft in (("target", 0), ("sd", k)):
        command = [
            str(VLLM_PYTHON), "-m", "fsd_vllm.offline", "--k", str(num_draft), "--draft-layers", str(draft_layers),
            "--batch", *map(str, batches), "--temperature", "0", "--threshold", "0", "--max-tokens", str(max_tokens),
        ]
        env = {k_: v for k_, v in os.environ.items() if k_ not in ("PYTHONPATH", "VIRTUAL_ENV")}
        done = subprocess.run(command, capture_output=True, text=True, cwd="/tmp", env=env, check=False)
        lines = [x for x in done.stdout.splitlines() if x.startswith("FSD_VLLM_RUNS ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"vLLM run failed (rc={done.returncode}): {done.stderr[-3000:]}")
        for run in json.loads(lines[-1].removeprefix("FSD_VLLM_RUNS "))["runs"]:
            counters = run["counters"]
            rows.append({
                "engine": "vllm", "mode": mode, "batch": run["batch"], "tokens": run["generated_tokens"],
                "seconds": run["seconds"], "tokens_per_s": run["tokens_per_s"],
                "acceptance_rate": counters["accepted"] / counters["drafted"] if counters.get("drafted") else None,
                "engine_start_s": run["engine_start_s"],
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--draft-layers", type=int, default=24)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--skip-native", action="store_true")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no vLLM environment at {VLLM_PYTHON.parent.parent}: run `make vllm-env`")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    target = default_target_dir()
    if not (target / "config.json").exists():
        load_pair("smollm2-135m")  # dequantizes the GGUF into the cache once
    draft = truncated_draft(target, args.draft_layers)
    rows = [] if args.skip_native else native_runs(target, draft, args.k, args.batches, args.max_tokens)
    rows += vllm_runs(args.draft_layers, args.k, args.batches, args.max_tokens)
    print(json.dumps({
        "command": " ".join(sys.argv),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pair": f"{target} drafted by its first {args.draft_layers} layers",
        "k": args.k, "greedy": True, "max_tokens": args.max_tokens,
        "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
