"""Quality against speed: HumanEval pass@1 for target-alone, SD and FSD across thresholds.

The paper's claim (Holsman et al., ACL Findings 2025) is a tunable accuracy-runtime trade-off; this
script measures it on a fixed, seeded subset of HumanEval with our engine, for each *setting*:

    target          the target model alone (plain decoding with a KV cache, no draft)
    sd              standard speculative decoding (FSD at T = 0, reducible rule)
    kl@0.3          FSD, reducible rule (the default), divergence kl, threshold 0.3
    pure/kl@1.0     FSD with the paper's released "pure" rule at T = 1.0

and each *mode*: ``greedy`` (temperature 0) and ``sample`` (temperature 0.6, top-p 0.9, as the paper's
script), one completion per (setting, mode, task). Greedy makes the two rules identical (see
decoder/acceptance.py), so ``pure/...`` settings are skipped in greedy mode.

Output in ``--out`` (default results/quality/):

* ``samples.jsonl`` — one line per (setting, mode, task): completion, pass/fail and why, tokens, time,
  acceptance and distortion. Appended and fsync-ed line by line; a restart skips what is there, so an
  interrupted run resumes where it stopped (a torn last line is dropped).
* ``run.json`` — the run's fixed configuration (pair, k, max_new_tokens, subset seed, prompt format,
  the task ids in order); a restart with a different one is refused rather than mixing results.
* ``summary.json`` — per mode and setting, over the tasks every setting of that mode has finished:
  pass@1 with a 95% Wilson score interval, tokens/s (generated tokens / generation wall time, prefill
  included), acceptance rate, mean distortion per token, speed-up over target and SD, and a paired
  comparison with SD on the same tasks (difference, discordant pairs, exact McNemar p-value).
* ``quality.png`` — pass@1 (Wilson error bars) against tokens/s, and against mean distortion.

Work order is mode, then task, then setting: at any moment every setting of a mode has (nearly) the
same tasks done, so a partial run is already a fair comparison, and machine-load drift hits all
settings alike.

    .venv/bin/python benchmarks/quality.py --pair smollm2-135m --limit 3 --settings target,sd,kl@1.0 \\
        --modes greedy --max-new-tokens 128 --out results/quality-smoke        # smoke run
    nice -n 10 .venv/bin/python benchmarks/quality.py --limit 40 --modes greedy  # the real run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import humaneval  # noqa: E402
from benchmarks.stats import sign_test_p  # noqa: E402

DEFAULT_PAIR = "qwen2.5-coder-1.5b"
DEFAULT_SETTINGS = "target,sd,kl@0.05,kl@0.3,kl@1.0,kl@3.0,pure/kl@1.0"
MODES: dict[str, tuple[float, float]] = {"greedy": (0.0, 1.0), "sample": (0.6, 0.9)}  # (temperature, top_p)
Z_95 = 1.959963984540054


# ----------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One decoding configuration. ``kind`` "target" decodes with the target alone."""

    name: str
    kind: str  # "target" | "fsd"
    div: str = "kl"
    rule: str = "reducible"
    threshold: float = 0.0


def parse_setting(spec: str) -> Setting:
    """``target`` | ``sd`` | ``[rule/]div@T`` (e.g. ``kl@0.3``, ``pure/kl@1.0``); ValueError otherwise."""
    from decoder.acceptance import DIVERGENCES, RULES

    text = spec.strip()
    if text == "target":
        return Setting("target", "target")
    if text == "sd":
        return Setting("sd", "fsd", "kl", "reducible", 0.0)
    rule, _, rest = text.rpartition("/")
    rule = rule or "reducible"
    div, at, threshold_text = rest.partition("@")
    if not at or rule not in RULES or div not in DIVERGENCES:
        raise ValueError(
            f"bad setting {spec!r}: expected 'target', 'sd' or '[rule/]div@T' with rule in {RULES} "
            f"and div in {DIVERGENCES}"
        )
    try:
        threshold = float(threshold_text)
    except ValueError:
        raise ValueError(f"bad threshold {threshold_text!r} in setting {spec!r}") from None
    if not math.isfinite(threshold) or threshold < 0:
        raise ValueError(f"threshold must be finite and >= 0, got {threshold_text!r} in setting {spec!r}")
    name = f"{div}@{threshold:g}" if rule == "reducible" else f"{rule}/{div}@{threshold:g}"
    return Setting(name, "fsd", div, rule, threshold)


def parse_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"empty {what} list {text!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"duplicate entries in {what} list {text!r}")
    return items


# ----------------------------------------------------------------------------------------- decoding


@dataclass
class Generation:
    """One decoded completion and its counters."""

    text: str
    new_tokens: int
    time_s: float
    finish_reason: str | None
    drafted: int = 0
    accepted: int = 0
    fuzzy_accepted: int = 0
    distortion: float = 0.0
    iterations: int = 0


def target_only_decode(pair: Any, prompt_ids: list[int], params: Any) -> Generation:
    """The baseline: the target alone (decoder/baseline.py), as a :class:`Generation`."""
    from decoder.baseline import target_only_decode as decode_target_only

    out = decode_target_only(pair, prompt_ids, params)
    n = len(out.token_ids)
    return Generation(out.text, n, out.time_s, out.finish_reason, iterations=n)


class Decoders:
    """Runs a setting on one prompt; one FSDEngine per (div, rule), reused across tasks."""

    def __init__(self, pair: Any, num_draft_tokens: int) -> None:
        self.pair = pair
        self.num_draft_tokens = num_draft_tokens
        self._engines: dict[tuple[str, str], Any] = {}
        self._next_id = 0

    def _engine(self, setting: Setting) -> Any:
        from decoder.engine import FSDEngine

        key = (setting.div, setting.rule)
        if key not in self._engines:
            self._engines[key] = FSDEngine(
                self.pair,
                num_draft_tokens=self.num_draft_tokens,
                div=setting.div,
                rule=setting.rule,
                max_batch_size=1,
            )
        return self._engines[key]

    def generate(self, setting: Setting, prompt_ids: list[int], params: Any) -> Generation:
        if setting.kind == "target":
            return target_only_decode(self.pair, prompt_ids, params)
        engine = self._engine(setting)
        self._next_id += 1
        request_id = f"q{self._next_id}"
        started = time.perf_counter()
        engine.add_request(request_id, prompt_ids, params, setting.threshold)
        engine.run_to_completion()
        elapsed = time.perf_counter() - started
        out = engine.release(request_id)
        return Generation(
            text=out.text,
            new_tokens=len(out.token_ids),
            time_s=elapsed,
            finish_reason=out.finish_reason,
            drafted=out.drafted,
            accepted=out.accepted,
            fuzzy_accepted=out.fuzzy_accepted,
            distortion=out.distortion,
            iterations=out.iterations,
        )


def load_model_pair(name: str) -> Any:
    """A registered pair by name (``tiny``: random weights, for tests and plumbing checks) or 'target,draft'."""
    from decoder.pairs import load_pair

    # max_context: a pair built in memory gets room for HumanEval prompts (400-2000 byte tokens with the
    # tiny byte-level tokenizer); loaded pairs keep their own context.
    return load_pair(name, max_context=4096)


def prompt_ids(pair: Any, problem: humaneval.Problem) -> list[int]:
    ids = list(pair.encode_prompt(humaneval.chat_messages(problem)))
    return ids + list(pair.tokenizer.encode(humaneval.response_prefix(problem), add_special_tokens=False))


# ------------------------------------------------------------------------------------------ storage


class SampleStore:
    """``samples.jsonl``: append-only, one fsync-ed line per (setting, mode, task)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[tuple[str, str, str], dict[str, Any]] = {}
        if path.exists():
            self._load()

    @staticmethod
    def key(record: dict[str, Any]) -> tuple[str, str, str]:
        return (record["setting"], record["mode"], record["task_id"])

    def _load(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # torn last line from a crash mid-write: drop it
            data = data[: data.rfind(b"\n") + 1]
            with open(self.path, "r+b") as f:
                f.truncate(len(data))
        for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{self.path}:{number} is not JSON ({exc}); fix or remove that line"
                ) from None
            self.records[self.key(record)] = record

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        return key in self.records

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[self.key(record)] = record

    def rewrite(self) -> None:
        """Replace the file with the current records (used after re-scoring); atomic rename."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for record in self.records.values():
                f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)


def check_run_config(path: Path, config: dict[str, Any]) -> None:
    """Write ``run.json``, or refuse if an existing one disagrees on a field that changes results.

    The task list may grow (nested subsets); settings and modes may change (they are keys per line).
    """
    if path.exists():
        previous = json.loads(path.read_text())
        for field in ("pair", "num_draft_tokens", "max_new_tokens", "subset_seed", "prompt_format"):
            if previous.get(field) != config[field]:
                raise ValueError(
                    f"{path} was written with {field}={previous.get(field)!r} but this run has "
                    f"{field}={config[field]!r}; use another --out directory"
                )
        old_tasks, new_tasks = previous.get("task_ids", []), config["task_ids"]
        if len(new_tasks) < len(old_tasks):
            config = {**config, "task_ids": old_tasks}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------- statistics


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (no continuity correction)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n!r}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes!r}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(
    records: Iterable[dict[str, Any]], settings: Sequence[str], modes: Sequence[str]
) -> dict[str, Any]:
    """Per mode and setting, over the tasks that every listed setting of that mode has finished."""
    by_key: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in records:
        by_key.setdefault((r["mode"], r["setting"]), {})[r["task_id"]] = r
    summary: dict[str, Any] = {"interval": "95% Wilson score interval over tasks", "modes": {}}
    for mode in modes:
        present = [s for s in settings if (mode, s) in by_key]
        if not present:
            continue
        common = set.intersection(*(set(by_key[(mode, s)]) for s in present))
        tasks = sorted(common, key=lambda t: int(t.rsplit("/", 1)[1]))
        rows: dict[str, Any] = {}
        for s in present:
            recs = [by_key[(mode, s)][t] for t in tasks]
            n = len(recs)
            passed = sum(bool(r["passed"]) for r in recs)
            tokens = sum(r["new_tokens"] for r in recs)
            seconds = sum(r["time_s"] for r in recs)
            drafted = sum(r["drafted"] for r in recs)
            row: dict[str, Any] = {
                "n": n,
                "passed": passed,
                "pass_at_1": passed / n if n else None,
                "pass_at_1_ci95": list(wilson_interval(passed, n)) if n else None,
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
                "new_tokens": tokens,
                "generation_s": seconds,
                "acceptance_rate": sum(r["accepted"] for r in recs) / drafted if drafted else None,
                "fuzzy_accept_fraction": sum(r["fuzzy_accepted"] for r in recs) / drafted
                if drafted
                else None,
                "mean_distortion": sum(r["distortion"] for r in recs) / tokens if tokens else 0.0,
                "tokens_per_iteration": tokens / max(1, sum(r["iterations"] for r in recs)),
                "timeouts": sum(r["status"] == "timeout" for r in recs),
                "finished_by_length": sum(r["finish_reason"] == "length" for r in recs),
            }
            rows[s] = row
        for s, row in rows.items():
            for base in ("target", "sd"):
                if base in rows and rows[base]["tokens_per_s"] and row["tokens_per_s"]:
                    row[f"speedup_vs_{base}"] = row["tokens_per_s"] / rows[base]["tokens_per_s"]
            if "target" in rows and tasks:
                # Greedy SD must reproduce the target's text (up to bf16 batch-shape rounding); FSD drifts.
                same = sum(
                    by_key[(mode, s)][t].get("completion") == by_key[(mode, "target")][t].get("completion")
                    for t in tasks
                )
                row["same_completion_as_target"] = same / len(tasks)
            if "sd" in rows and s != "sd" and tasks:
                sd_pass = {t: bool(by_key[(mode, "sd")][t]["passed"]) for t in tasks}
                own_pass = {t: bool(by_key[(mode, s)][t]["passed"]) for t in tasks}
                only_sd = sum(sd_pass[t] and not own_pass[t] for t in tasks)
                only_own = sum(own_pass[t] and not sd_pass[t] for t in tasks)
                low, high = rows["sd"]["pass_at_1_ci95"]
                row["vs_sd"] = {
                    "pass_at_1_diff": row["pass_at_1"] - rows["sd"]["pass_at_1"],
                    "solved_only_by_sd": only_sd,
                    "solved_only_by_this": only_own,
                    "mcnemar_exact_p": sign_test_p(only_sd, only_own),
                    "within_sd_ci95": low <= row["pass_at_1"] <= high,
                }
        summary["modes"][mode] = {"tasks": tasks, "settings": rows}
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as one Markdown table (the README's): a row per mode and setting."""
    def num(x: float | None, digits: int = 2) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    lines = ["| mode | setting | pass@1 (95% CI) | tokens/s | × target | × SD | acceptance | mean distortion "
             "| tokens/iter | vs SD: only SD / only this (McNemar p) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, block in summary["modes"].items():
        for name, row in block["settings"].items():
            ci = row["pass_at_1_ci95"]  # None when the settings share no finished task
            interval = f"{num(ci[0])}–{num(ci[1])}" if ci else "–"
            vs = row.get("vs_sd")
            versus = f"{vs['solved_only_by_sd']} / {vs['solved_only_by_this']} ({vs['mcnemar_exact_p']:.2f})" if vs else "–"
            lines.append(
                f"| {mode} | {name} | {row['passed']}/{row['n']} = {num(row['pass_at_1'])} ({interval}) "
                f"| {num(row['tokens_per_s'])} | {num(row.get('speedup_vs_target'))} | {num(row.get('speedup_vs_sd'))} "
                f"| {num(row['acceptance_rate'])} | {num(row['mean_distortion'], 3)} | {num(row['tokens_per_iteration'])} "
                f"| {versus} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- plot


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Two panels: pass@1 (Wilson 95% error bars) against tokens/s and against mean distortion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = {"greedy": "o", "sample": "s"}
    for mode, block in summary["modes"].items():
        for ax, x_field, x_label in (
            (axes[0], "tokens_per_s", "tokens/s (generation, prefill included)"),
            (axes[1], "mean_distortion", "mean distortion per token (TV·1[D≤T])"),
        ):
            points = [(s, r) for s, r in block["settings"].items() if r["n"] and r[x_field] is not None]
            if not points:
                continue
            xs = [r[x_field] for _, r in points]
            ys = [r["pass_at_1"] for _, r in points]
            yerr = [
                [y - r["pass_at_1_ci95"][0] for y, (_, r) in zip(ys, points, strict=True)],
                [r["pass_at_1_ci95"][1] - y for y, (_, r) in zip(ys, points, strict=True)],
            ]
            n = points[0][1]["n"]
            ax.errorbar(xs, ys, yerr=yerr, fmt=markers.get(mode, "^"), capsize=3, label=f"{mode} (n={n})")
            for x, y, (s, _) in zip(xs, ys, points, strict=True):
                ax.annotate(s, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            ax.set_xlabel(x_label)
    for ax in axes:
        ax.set_ylabel("HumanEval pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--pair", default=DEFAULT_PAIR, help="shipped pair name, 'tiny' (random), or 'target,draft' paths"
    )
    ap.add_argument("--limit", type=int, default=40, help="problems in the seeded subset (0 = all 164)")
    ap.add_argument("--subset-seed", type=int, default=0, help="seed of the subset shuffle (and of sampling)")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma list: target, sd, [rule/]div@T")
    ap.add_argument("--modes", default="greedy,sample", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per test program")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", default="results/quality", help="output directory (resumable)")
    ap.add_argument(
        "--rescore", action="store_true", help="re-run the tests on stored completions; no decoding"
    )
    ap.add_argument(
        "--summary-only",
        action="store_true",
        help="summarise what --out holds (over the tasks every setting finished); no decoding",
    )
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    ap.add_argument(
        "--reverse",
        action="store_true",
        help="take the tasks last to first: a second process on a copy of --out meets the first in the "
        "middle (merge the two samples.jsonl; a task both finished is kept once)",
    )
    return ap


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run (or resume) the benchmark; returns the summary plus ``generated`` (new completions this run)."""
    args = build_parser().parse_args(argv)
    settings = [parse_setting(s) for s in parse_list(args.settings, "settings")]
    if len({s.name for s in settings}) != len(settings):
        raise ValueError(f"settings {args.settings!r} name the same setting twice")
    modes = parse_list(args.modes, "modes")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    out_dir = Path(args.out)
    problems = humaneval.select_subset(humaneval.load_problems(), args.limit or None, args.subset_seed)
    config = {
        "pair": args.pair,
        "num_draft_tokens": args.num_draft_tokens,
        "max_new_tokens": args.max_new_tokens,
        "subset_seed": args.subset_seed,
        "prompt_format": humaneval.PROMPT_FORMAT,
        "modes": {m: {"temperature": MODES[m][0], "top_p": MODES[m][1]} for m in modes},
        "stop": list(humaneval.STOP_STRINGS),
        "task_ids": [p.task_id for p in problems],
    }
    check_run_config(out_dir / "run.json", config)
    store = SampleStore(out_dir / "samples.jsonl")
    by_id = {p.task_id: p for p in problems}

    if args.rescore:
        for record in store.records.values():
            problem = by_id.get(record["task_id"])
            if problem is not None:
                result = humaneval.evaluate(problem, record["completion"], args.exec_timeout)
                record.update(passed=result.passed, status=result.status, detail=result.detail)
        store.rewrite()
        generated = 0
    elif args.summary_only:
        generated = 0
    else:
        generated = _generate_all(args, settings, modes, problems, store)

    names = [s.name for s in settings]
    task_ids = set(by_id)  # a store may hold more tasks (an earlier, larger --limit): report this subset
    summary = summarize([r for r in store.records.values() if r["task_id"] in task_ids], names, modes)
    summary.update(
        pair=args.pair,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        subset_seed=args.subset_seed,
        sandbox="netns" if humaneval.network_isolation() else "socket-guard",
        command="python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(markdown_table(summary))
    if summary["modes"]:
        plot(
            summary,
            out_dir / "quality.png",
            f"HumanEval pass@1 vs speed — {args.pair}, k={args.num_draft_tokens}, subset of {len(problems)}",
        )
    summary["generated"] = generated
    return summary


def _pending(
    settings: Sequence[Setting],
    modes: Sequence[str],
    problems: Sequence[humaneval.Problem],
    store: SampleStore,
) -> list[tuple[str, humaneval.Problem, Setting]]:
    work = []
    for mode in modes:
        for problem in problems:
            for setting in settings:
                if mode == "greedy" and setting.rule == "pure":
                    continue  # identical to the reducible rule at temperature 0
                if (setting.name, mode, problem.task_id) not in store:
                    work.append((mode, problem, setting))
    return work


def _generate_all(
    args: argparse.Namespace,
    settings: Sequence[Setting],
    modes: Sequence[str],
    problems: Sequence[humaneval.Problem],
    store: SampleStore,
) -> int:
    work = _pending(settings, modes, problems[::-1] if args.reverse else problems, store)
    if not work:
        return 0
    import torch
    from tqdm import tqdm

    from decoder.engine import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_model_pair(args.pair)
    decoders = Decoders(pair, args.num_draft_tokens)
    # Warm-up (lazy kernel init, allocator) so the first timed task is not penalised.
    warm = SamplingParams(temperature=0.0, max_new_tokens=4, eos_token_ids=())
    first_ids = prompt_ids(pair, problems[0])
    for setting in {s.kind: s for s in settings}.values():
        decoders.generate(setting, first_ids, warm)

    bar = tqdm(work, disable=args.no_progress, unit="sample", smoothing=0.05, dynamic_ncols=True)
    for mode, problem, setting in bar:
        bar.set_description(f"{mode} {setting.name} {problem.task_id}")
        temperature, top_p = MODES[mode]
        seed = args.subset_seed * 1_000_003 + problem.number  # the same per task for every setting
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=args.max_new_tokens,
            stop=humaneval.STOP_STRINGS,
            seed=seed,
        )
        ids = prompt_ids(pair, problem)
        gen = decoders.generate(setting, ids, params)
        result = humaneval.evaluate(problem, gen.text, args.exec_timeout)
        store.append(
            {
                "setting": setting.name,
                "mode": mode,
                "task_id": problem.task_id,
                "seed": seed,
                "threshold": setting.threshold,
                "rule": setting.rule if setting.kind == "fsd" else None,
                "div": setting.div if setting.kind == "fsd" else None,
                "prompt_tokens": len(ids),
                "completion": gen.text,
                "passed": result.passed,
                "status": result.status,
                "detail": result.detail,
                "tokens_per_s": gen.new_tokens / gen.time_s if gen.time_s > 0 else None,
                **{k: v for k, v in asdict(gen).items() if k != "text"},
            }
        )
    return len(work)


def main() -> int:
    try:
        summary = run()
    except ValueError as exc:
        print(f"quality: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
