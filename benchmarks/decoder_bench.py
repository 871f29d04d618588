"""Decoder benchmark: target alone vs our k = 0 vs SD vs FSD sweeps vs HF assisted generation, on one pair.

Every setting decodes the same fixed prompts one at a time (batch size 1, eos ignored so every
setting emits the same number of tokens) and reports tokens/s, acceptance, tokens per iteration,
mean distortion, draft/verify time per iteration and efficiency (defined in the JSON's
``definitions``). Settings are interleaved per prompt (prompt-major), so a load change on a shared
machine hits every setting alike; ``summary`` holds the ratios the decoder targets are stated in.
Prints one JSON document and writes it to ``--out``.

    python benchmarks/decoder_bench.py --quick                 # tiny random pair, seconds
    python benchmarks/decoder_bench.py --pair smollm2-135m     # the full run (tens of minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from decoder.baseline import target_only_decode  # noqa: E402
from decoder.engine import FSDEngine, SamplingParams  # noqa: E402
from decoder.pairs import find_pair_spec, load_pair  # noqa: E402

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for sleeping better.",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short, friendly email declining a meeting invitation.",
]
CODE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a JavaScript function that debounces another function.",
]
PROMPTS = [p for pair in zip(CHAT_PROMPTS, CODE_PROMPTS, strict=True) for p in pair]
ACCEPT_ALL_T = 1e9  # with div "tv" (bounded by 1) every draft token passes the fuzzy test

DEFINITIONS = {
    "tokens_per_s": "generated tokens / wall time, prefill included, summed over prompts (batch size 1)",
    "decode_tokens_per_s": "generated tokens / (wall time - prefill time)",
    "acceptance_rate": "accepted draft tokens / drafted tokens (exact + fuzzy acceptances)",
    "tokens_per_iteration": "generated tokens / draft-verify iterations",
    "mean_distortion": "sum over emitted positions of TV(p,q)*1[D<=T], per generated token",
    "t_draft_single_s": "median time of one 1-token draft forward with a KV cache (HF DynamicCache)",
    "t_verify_s": "median time of one (k+1)-token target forward with a KV cache (HF DynamicCache)",
    "t_target_single_s": "median time of one 1-token target forward with a KV cache (HF DynamicCache)",
    "efficiency": "decode_tokens_per_s / (tokens_per_iteration / (k * t_draft_single_s + t_verify_s)): "
    "achieved speed over what the measured raw forward times allow at the achieved acceptance "
    "(k = 0 and target alone: over 1 / t_target_single_s); 1 - efficiency is the loop overhead",
    "k0_vs_target_only": "tokens_per_s of our engine at k = 0 / tokens_per_s of the plain target loop (target >= 0.98)",
    "sd_vs_hf_assisted": "tokens_per_s of our SD (T = 0) / HF assisted generation, same k and draft (target >= 1.25)",
}


@dataclass
class Setting:
    name: str
    kind: str  # "target_only" | "engine" | "hf_assisted"
    threshold: float = 0.0
    div: str = "kl"
    rule: str = "reducible"
    k: int | None = None  # None: --k


def build_settings(thresholds: list[float], divs: list[str], pure_thresholds: list[float], hf: bool) -> list[Setting]:
    settings = [Setting("target_only", "target_only"), Setting("k0", "engine", 0.0, k=0), Setting("sd", "engine", 0.0)]
    for div in divs:
        settings += [Setting(f"fsd_{div}_T{t:g}", "engine", t, div) for t in thresholds]
    settings += [Setting(f"fsd_kl_pure_T{t:g}", "engine", t, "kl", "pure") for t in pure_thresholds]
    settings.append(Setting("accept_all", "engine", ACCEPT_ALL_T, "tv"))
    if hf:
        settings.append(Setting("hf_assisted", "hf_assisted"))
    return settings


# ------------------------------------------------------------------------------------------ runners


def run_target_only(pair: Any, prompt: list[int], params: SamplingParams) -> dict[str, float]:
    """Plain autoregressive decoding with the target and a KV cache (the baseline, decoder/baseline.py)."""
    out = target_only_decode(pair, prompt, params)
    tokens = len(out.token_ids)
    return {"tokens": tokens, "time_s": out.time_s, "prefill_s": out.prefill_s, "iterations": tokens}


@torch.inference_mode()
def run_engine(pair: Any, prompt: list[int], params: SamplingParams, setting: Setting, k: int) -> dict[str, float]:
    engine = FSDEngine(pair, num_draft_tokens=k, div=setting.div, rule=setting.rule, max_batch_size=1)
    engine.add_request("r", prompt, params, threshold=setting.threshold)
    prefill = draft = verify = 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        stats = engine.step()
        prefill += stats.prefill_time_s
        draft += stats.draft_time_s
        verify += stats.verify_time_s
    elapsed = time.perf_counter() - start
    out = engine.output("r")
    return {
        "tokens": len(out.token_ids),
        "time_s": elapsed,
        "prefill_s": prefill,
        "iterations": out.iterations,
        "drafted": out.drafted,
        "accepted": out.accepted,
        "fuzzy_accepted": out.fuzzy_accepted,
        "distortion": out.distortion,
        "draft_s": draft,
        "verify_s": verify,
    }


@torch.inference_mode()
def run_hf_assisted(pair: Any, prompt: list[int], params: SamplingParams, k: int) -> dict[str, float]:
    """transformers' assisted generation with a constant k (its adaptive schedule off, for parity)."""
    kwargs: dict[str, Any] = {"do_sample": not params.greedy}
    if not params.greedy:
        kwargs.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    torch.manual_seed(params.seed or 0)  # HF sampling draws from the global generator
    start = time.perf_counter()
    out = pair.target.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        assistant_model=pair.draft,
        num_assistant_tokens=k,
        num_assistant_tokens_schedule="constant",
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.max_new_tokens,  # suppresses eos, as eos is ignored elsewhere
        **kwargs,
    )
    return {"tokens": int(out.shape[1]) - len(prompt), "time_s": time.perf_counter() - start, "prefill_s": 0.0}


@torch.inference_mode()
def forward_times(pair: Any, prompt: list[int], k: int, reps: int) -> dict[str, float]:
    """Median raw forward times with a KV cache: one draft token, and k+1 target tokens."""
    from transformers import DynamicCache

    def timed(model: Any, width: int) -> float:
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        new = torch.tensor([prompt[-width:]])
        samples = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            model(input_ids=new, cache=cache, use_cache=True)
            samples.append(time.perf_counter() - start)
            cache.crop(-width)
        return statistics.median(samples[1:])  # the first call warms up

    return {
        "t_draft_single_s": timed(pair.draft, 1),
        "t_verify_s": timed(pair.target, k + 1),
        "t_target_single_s": timed(pair.target, 1),
    }


# ------------------------------------------------------------------------------------------ report


def summarize(setting: Setting, runs: list[dict[str, float]], k: int, times: dict[str, float]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in runs)
    elapsed = sum(r["time_s"] for r in runs)
    prefill = sum(r["prefill_s"] for r in runs)
    row: dict[str, Any] = {
        "setting": setting.name,
        "kind": setting.kind,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "decode_tokens_per_s": tokens / (elapsed - prefill) if prefill and elapsed > prefill else None,
    }
    if setting.kind == "target_only" and row["decode_tokens_per_s"]:
        row["efficiency"] = row["decode_tokens_per_s"] * times["t_target_single_s"]
    if setting.kind != "engine":
        return row
    k = setting.k if setting.k is not None else k
    iterations = sum(r["iterations"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    per_iter = tokens / iterations
    # k = 0: one target forward of one token per iteration (the bound of plain decoding).
    iteration_time = k * times["t_draft_single_s"] + times["t_verify_s"] if k else times["t_target_single_s"]
    ideal = per_iter / iteration_time
    row.update(
        threshold=setting.threshold,
        div=setting.div,
        rule=setting.rule,
        k=k,
        acceptance_rate=sum(r["accepted"] for r in runs) / drafted if drafted else None,
        fuzzy_accepted=sum(r["fuzzy_accepted"] for r in runs),
        tokens_per_iteration=per_iter,
        mean_distortion=sum(r["distortion"] for r in runs) / tokens,
        draft_time_per_iteration_s=sum(r["draft_s"] for r in runs) / iterations,
        verify_time_per_iteration_s=sum(r["verify_s"] for r in runs) / iterations,
        ideal_decode_tokens_per_s=ideal,
        efficiency=row["decode_tokens_per_s"] / ideal if row["decode_tokens_per_s"] else None,
    )
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the decoder targets are stated in (None where a setting was not run)."""
    by_name = {r["setting"]: r for r in rows}

    def ratio(a: str, b: str) -> float | None:
        if a in by_name and b in by_name:
            return float(by_name[a]["tokens_per_s"] / by_name[b]["tokens_per_s"])
        return None

    fsd = [r for r in rows if r["setting"].startswith("fsd_")]
    return {
        "k0_vs_target_only": ratio("k0", "target_only"),
        "sd_vs_hf_assisted": ratio("sd", "hf_assisted"),
        "sd_vs_target_only": ratio("sd", "target_only"),
        "fsd_vs_sd": {r["setting"]: ratio(r["setting"], "sd") for r in fsd},
        "fsd_mean_distortion": {r["setting"]: r["mean_distortion"] for r in fsd},
        "efficiency": {r["setting"]: r.get("efficiency") for r in rows if r.get("efficiency") is not None},
    }


def paired_ratio(runs: dict[str, list[dict[str, float]]], a: str, b: str) -> dict[str, float]:
    """Mean and 95 % t-interval of the per-run tokens/s ratio a / b over runs made back to back (same prompt,
    same seed): the machine's drift hits both sides of a pair, unlike the ratio of pooled rates."""
    from scipy import stats

    r = np.array([x["tokens"] / x["time_s"] / (y["tokens"] / y["time_s"]) for x, y in zip(runs[a], runs[b], strict=True)])
    half = float(stats.t.ppf(0.975, len(r) - 1) * r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else float("nan")
    return {"mean": float(r.mean()), "ci95_low": float(r.mean()) - half, "ci95_high": float(r.mean()) + half, "n": len(r)}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["modes"]), figsize=(6 * len(report["modes"]), 4.5), squeeze=False)
    for ax, (mode, rows) in zip(axes[0], report["modes"].items(), strict=True):
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if row["kind"] == "engine" and row["setting"] not in ("sd", "accept_all"):
                groups.setdefault(f"{row['div']} {row['rule']}", []).append(row)
        for label, group in groups.items():
            group.sort(key=lambda r: r["mean_distortion"])
            ax.plot([r["mean_distortion"] for r in group], [r["tokens_per_s"] for r in group], "o-", label=label)
        for row in rows:
            if row["setting"] in ("sd", "accept_all"):
                ax.plot(row["mean_distortion"], row["tokens_per_s"], "k*", ms=10)
                ax.annotate(row["setting"], (row["mean_distortion"], row["tokens_per_s"]))
            elif row["kind"] != "engine":
                ax.axhline(row["tokens_per_s"], ls="--", lw=1, color="gray")
                ax.annotate(row["setting"], (0, row["tokens_per_s"]))
        ax.set_xlabel("mean distortion per token (TV bound)")
        ax.set_ylabel("tokens/s (batch 1, incl. prefill)")
        ax.set_title(f"{report['pair']} — {mode}, k={report['k']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="smollm2-135m", help='pair name, or "tiny"')
    parser.add_argument("--prompts", type=int, default=8, help=f"how many of the {len(PROMPTS)} built-in prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--thresholds", default="0.1,0.3,1.0,3.0")
    parser.add_argument("--pure-thresholds", default="0.3,1.0", help="T values for the pure-vs-reducible pair")
    parser.add_argument("--divs", default="kl,js,draft_tokens")
    parser.add_argument("--modes", default="greedy,sample", help="greedy and/or sample (temperature 0.7)")
    parser.add_argument("--settings", default="", help="comma list of setting names to keep (default: all)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF assisted generation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--draft-dtype", default=None,
                    help="draft dtype override: int8 (per-tensor activations), int8-row (per-row: batch-invariant) or a float dtype")
    parser.add_argument("--reps", type=int, default=10, help="repetitions for the raw forward timings")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the prompts (more paired samples for the per-run ratios' CIs)")
    parser.add_argument("--quick", action="store_true", help="tiny pair, 2 prompts, 12 tokens: a smoke run")
    parser.add_argument("--out", default="results/decoder_bench.json")
    parser.add_argument("--plot", default="", help="also write a tokens/s-vs-distortion PNG here")
    args = parser.parse_args(argv)

    if args.quick:
        args.pair, args.prompts, args.max_new_tokens, args.reps = "tiny", 2, 12, 3
        args.thresholds, args.divs, args.pure_thresholds = "0.3,1.0", "kl,js", "0.3"
    if args.threads:
        torch.set_num_threads(args.threads)
    elif (spec := find_pair_spec(args.pair)) is not None and spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be in 1..{len(PROMPTS)}, got {args.prompts}")
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    pure_thresholds = [float(t) for t in args.pure_thresholds.split(",") if t]
    divs = [d for d in args.divs.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"greedy", "sample"}:
        raise SystemExit(f"unknown mode in --modes {args.modes!r}; use greedy and/or sample")

    load_start = time.perf_counter()
    pair = load_pair(args.pair, draft_dtype=args.draft_dtype)
    load_s = time.perf_counter() - load_start
    prompts = [pair.encode_prompt(p) for p in PROMPTS[: args.prompts]]
    settings = build_settings(thresholds, divs, pure_thresholds, hf=not args.no_hf)
    if args.settings:
        keep = set(args.settings.split(","))
        settings = [s for s in settings if s.name in keep]
    times = forward_times(pair, prompts[0], args.k, args.reps)

    report: dict[str, Any] = {
        "benchmark": "decoder",
        "command": " ".join(["python", "benchmarks/decoder_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "pair": pair.name,
        "pair_description": getattr(pair, "description", ""),
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": "cpu",
        "load_average_at_start": os.getloadavg(),
        "load_s": load_s,
        "forward_times": times,
        "definitions": DEFINITIONS,
        "modes": {},
    }
    report["summary"] = {}
    for mode in modes:
        runs_by_setting: dict[str, list[dict[str, float]]] = {s.name: [] for s in settings}
        for i, prompt in [(i, p) for _ in range(args.rounds) for i, p in enumerate(prompts)]:  # settings interleaved
            params = SamplingParams(
                temperature=0.0 if mode == "greedy" else 0.7,
                max_new_tokens=args.max_new_tokens,
                eos_token_ids=(),
                seed=1000 + i,
            )
            for setting in settings:
                if setting.kind == "target_only":
                    run = run_target_only(pair, prompt, params)
                elif setting.kind == "hf_assisted":
                    run = run_hf_assisted(pair, prompt, params, args.k)
                else:
                    run = run_engine(pair, prompt, params, setting, setting.k if setting.k is not None else args.k)
                runs_by_setting[setting.name].append(run)
                print(f"[{mode}] prompt {i} {setting.name}: {run['tokens'] / run['time_s']:.1f} tok/s", file=sys.stderr, flush=True)
        rows = [summarize(s, runs_by_setting[s.name], args.k, times) for s in settings]
        baseline = {r["setting"]: r["tokens_per_s"] for r in rows}
        for row in rows:
            if "target_only" in baseline:
                row["speedup_vs_target"] = row["tokens_per_s"] / baseline["target_only"]
            if "hf_assisted" in baseline:
                row["speedup_vs_hf_assisted"] = row["tokens_per_s"] / baseline["hf_assisted"]
        report["modes"][mode] = rows
        report["summary"][mode] = ratios(rows)
        report["summary"][mode]["paired"] = {
            f"{a}_vs_{b}": paired_ratio(runs_by_setting, a, b)
            for a, b in (("k0", "target_only"), ("sd", "hf_assisted"), ("sd", "target_only"))
            if runs_by_setting.get(a) and runs_by_setting.get(b)
        }

    emit(report, args.out, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
