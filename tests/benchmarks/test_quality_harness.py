"""The HumanEval quality harness: extraction, sandboxed execution, statistics, resumable runs."""

from __future__ import annotations

import ast
import json
import socket
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import binomtest

from benchmarks import humaneval
from benchmarks.humaneval import Problem, extract_solution, load_problems, run_program, select_subset
from benchmarks.quality import (
    check_run_config,
    markdown_table,
    parse_setting,
    run,
    summarize,
    wilson_interval,
)


@pytest.fixture(scope="module")
def problems() -> dict[str, Problem]:
    return {p.task_id: p for p in load_problems()}


def function_ast(source: str, name: str) -> str:
    """The AST dump of the last top-level definition of ``name`` in ``source``."""
    defs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert defs, f"no def {name} in:\n{source}"
    return ast.dump(defs[-1])


# ----------------------------------------------------------------------------------------- data


def test_subset_is_seeded_nested_and_validated(problems: dict[str, Problem]) -> None:
    everything = load_problems()
    assert len(everything) == 164 and everything[0].task_id == "HumanEval/0"
    first = [p.task_id for p in select_subset(everything, 40, seed=0)]
    again = [p.task_id for p in select_subset(everything, 40, seed=0)]
    larger = [p.task_id for p in select_subset(everything, 80, seed=0)]
    other = [p.task_id for p in select_subset(everything, 40, seed=1)]
    assert first == again and len(set(first)) == 40
    assert larger[:40] == first  # extending a run keeps the tasks already done
    assert other != first
    assert len(select_subset(everything, None, seed=0)) == 164
    with pytest.raises(ValueError, match="limit"):
        select_subset(everything, 0, seed=0)


# ------------------------------------------------------------------------------------ extraction

BODY_0 = (
    "\n    for i, a in enumerate(numbers):\n        for b in numbers[i + 1:]:\n"
    "            if abs(a - b) < threshold:\n                return True\n    return False"
)


def test_extracts_prefilled_continuation_and_drops_trailing_statements(problems: dict[str, Problem]) -> None:
    problem = problems["HumanEval/0"]
    completion = (
        BODY_0 + "\n\n\n# quick check\nprint(has_close_elements([1.0], 0.5))\nwhile True:\n    pass\n"
    )
    solution = extract_solution(problem, completion)
    assert solution.startswith("from typing import List")
    assert "print(" not in solution and "while True" not in solution and "quick check" not in solution
    assert function_ast(solution, "has_close_elements") == function_ast(
        problem.prompt + BODY_0, "has_close_elements"
    )
    assert run_program(humaneval.check_program(problem, solution)).passed


def test_extracts_from_a_whole_chat_answer_with_prose_and_several_blocks(
    problems: dict[str, Problem],
) -> None:
    problem = problems["HumanEval/0"]
    answer = textwrap.dedent(
        """\
        Here is an example of how it is called:
        ```python
        has_close_elements([1.0, 2.0], 0.5)
        ```
        And the implementation:
        ```python
        from typing import List

        def has_close_elements(numbers: List[float], threshold: float) -> bool:
            return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])

        if __name__ == "__main__":
            import doctest
            doctest.testmod()
        ```
        It compares every pair once.
        """
    )
    solution = extract_solution(problem, answer, prefilled=False)
    assert "__main__" not in solution and "It compares" not in solution and "Here is" not in solution
    assert "return any(" in solution
    assert run_program(humaneval.check_program(problem, solution)).passed


def test_keeps_a_helper_defined_after_the_function(problems: dict[str, Problem]) -> None:
    problem = problems["HumanEval/0"]
    completion = (
        "\n    return _any_close(sorted(numbers), threshold)\n\n\n"
        "def _any_close(xs, t):\n    return any(b - a < t for a, b in zip(xs, xs[1:]))\n\n\n"
        "assert has_close_elements([1.0, 1.1], 0.5)\n```"
    )
    solution = extract_solution(problem, completion)
    assert "def _any_close" in solution and "assert has_close" not in solution
    assert run_program(humaneval.check_program(problem, solution)).passed


def test_truncated_completion_loses_only_its_unparseable_tail(problems: dict[str, Problem]) -> None:
    problem = problems["HumanEval/0"]
    completion = BODY_0 + "\n\n\ndef unfinished(x):\n    return (x +"  # cut by max_new_tokens
    solution = extract_solution(problem, completion)
    assert "unfinished" not in solution
    assert function_ast(solution, "has_close_elements") == function_ast(
        problem.prompt + BODY_0, "has_close_elements"
    )


def test_prompt_helpers_are_kept_for_the_solution(problems: dict[str, Problem]) -> None:
    problem = problems["HumanEval/38"]  # decode_cyclic's tests call encode_cyclic from the prompt
    solution = extract_solution(problem, "\n    return encode_cyclic(encode_cyclic(s))\n```")
    assert "def encode_cyclic" in solution
    assert run_program(humaneval.check_program(problem, solution)).passed


def test_garbage_completion_yields_a_failing_program(problems: dict[str, Problem]) -> None:
    problem = problems["HumanEval/0"]
    result = run_program(humaneval.check_program(problem, extract_solution(problem, "S,\ufffdv\ufffdMMM")))
    assert result.status == "failed"


def test_every_canonical_solution_round_trips_through_extraction(problems: dict[str, Problem]) -> None:
    # The prompt ends right after the docstring (stripped); the model writes the newline and the body.
    for problem in problems.values():
        completion = "\n" + problem.canonical_solution.lstrip("\n").rstrip() + "\n```"
        solution = extract_solution(problem, completion)
        expected = problem.prompt + problem.canonical_solution
        assert function_ast(solution, problem.entry_point) == function_ast(expected, problem.entry_point), (
            problem.task_id
        )


# -------------------------------------------------------------------------------------- executor


def test_executor_passes_correct_and_fails_wrong_solutions(problems: dict[str, Problem]) -> None:
    problem = problems["HumanEval/0"]
    right = humaneval.evaluate(problem, "\n" + problem.canonical_solution.lstrip("\n"))
    wrong = humaneval.evaluate(problem, "\n    return True\n")
    assert right.status == "passed", right.detail
    assert wrong.status == "failed" and "AssertionError" in wrong.detail


def test_executor_times_out_an_infinite_loop_and_its_children() -> None:
    source = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\nwhile True:\n    pass\n"
    result = run_program(source, timeout_s=2.0)
    assert result.status == "timeout"
    assert not result.passed


def test_executor_runs_in_a_scratch_directory_with_a_clean_environment(tmp_path: Path) -> None:
    source = (
        "import os, sys\n"
        "assert 'fsd-humaneval-' in os.getcwd(), os.getcwd()\n"
        "assert not any(k.lower().endswith('_proxy') for k in os.environ), os.environ\n"
        "assert 'PYTHONPATH' not in os.environ and sys.flags.isolated\n"
        "assert sorted(os.listdir('.')) == ['program.py', 'stderr.txt'], os.listdir('.')\n"
    )
    result = run_program(source)
    assert result.passed, result.detail


class _Listener:
    """A TCP server on 127.0.0.1 that records whether anything connected."""

    def __init__(self) -> None:
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(4)
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


def test_executor_cannot_reach_the_network() -> None:
    listener = _Listener()
    try:
        # Through the socket module (blocked by the guard and by the namespace).
        via_socket = run_program(
            f"import socket\nsocket.create_connection(('127.0.0.1', {listener.port}), timeout=2)\n"
        )
        assert via_socket.status == "failed", via_socket
        if not humaneval.network_isolation():
            pytest.skip("no network namespace here (unshare -n unavailable): only the socket guard applies")
        # Around the guard, straight through _socket: only the network namespace stops this one.
        raw = (
            "import _socket\n"
            "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
            "s.settimeout(2)\n"
            f"s.connect(('127.0.0.1', {listener.port}))\n"
        )
        via_raw = run_program(raw)
        assert via_raw.status == "failed" and via_raw.isolation == "netns", via_raw
        assert "ConnectionRefused" in via_raw.detail or "unreachable" in via_raw.detail.lower(), (
            via_raw.detail
        )
    finally:
        listener.close()
    assert listener.connections == 0


# ------------------------------------------------------------------------------------ statistics


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    # Newcombe (1998), Stat. Med. 17:857, Table I, method 3 (Wilson score, no continuity correction).
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_interval_matches_published_values(successes: int, n: int, low: float, high: float) -> None:
    got = wilson_interval(successes, n)
    assert got == pytest.approx((low, high), abs=6e-5)


def test_wilson_interval_matches_scipy_and_rejects_bad_counts() -> None:
    for successes, n in [(0, 1), (20, 40), (39, 40), (40, 40), (7, 164)]:
        ci = binomtest(successes, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(successes, n) == pytest.approx((ci.low, ci.high), abs=1e-9)
    with pytest.raises(ValueError, match="n must be"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 4)


def record(setting: str, task: int, passed: bool, mode: str = "greedy", **overrides: Any) -> dict[str, Any]:
    base = {
        "setting": setting,
        "mode": mode,
        "task_id": f"HumanEval/{task}",
        "passed": passed,
        "status": "passed" if passed else "failed",
        "new_tokens": 100,
        "time_s": 10.0,
        "drafted": 80,
        "accepted": 60,
        "fuzzy_accepted": 0,
        "distortion": 0.0,
        "iterations": 25,
        "finish_reason": "stop",
    }
    return {**base, **overrides}


def test_summary_compares_settings_on_common_tasks_only() -> None:
    records = [record("target", t, passed=t < 6, completion=f"c{t}") for t in range(10)]
    records += [record("sd", t, passed=t < 6, completion=f"c{t}") for t in range(10)]
    records += [
        record("kl@1", t, passed=t < 4 or t == 8, time_s=5.0, fuzzy_accepted=20, distortion=3.0)
        for t in range(9)
    ]  # one task short: task 9 must be excluded from both
    summary = summarize(records, ["target", "sd", "kl@1"], ["greedy"])
    block = summary["modes"]["greedy"]
    assert len(block["tasks"]) == 9
    sd, fsd = block["settings"]["sd"], block["settings"]["kl@1"]
    assert (sd["n"], sd["passed"], fsd["passed"]) == (9, 6, 5)
    assert fsd["tokens_per_s"] == pytest.approx(20.0) and sd["tokens_per_s"] == pytest.approx(10.0)
    assert fsd["speedup_vs_sd"] == pytest.approx(2.0)
    assert fsd["mean_distortion"] == pytest.approx(0.03)
    assert fsd["acceptance_rate"] == pytest.approx(0.75)
    vs = fsd["vs_sd"]
    assert (vs["solved_only_by_sd"], vs["solved_only_by_this"]) == (2, 1)
    assert vs["pass_at_1_diff"] == pytest.approx(-1 / 9)
    assert vs["mcnemar_exact_p"] == pytest.approx(1.0)
    assert vs["within_sd_ci95"] is True
    assert sd["same_completion_as_target"] == 1.0 and fsd["same_completion_as_target"] == 0.0
    table = markdown_table(summary).splitlines()
    assert len(table) == 2 + 3
    assert table[4].startswith("| greedy | kl@1 | 5/9 = 0.56 (") and "| 2.00 |" in table[4]
    assert table[4].endswith("| 2 / 1 (1.00) |")


def test_summary_table_of_settings_without_a_common_task() -> None:
    records = [record("sd", 1, passed=True), record("kl@1", 2, passed=False)]  # no task done by both
    summary = summarize(records, ["sd", "kl@1"], ["greedy"])
    assert all(row["n"] == 0 for row in summary["modes"]["greedy"]["settings"].values())
    assert "| greedy | kl@1 | 0/0 = – (–) |" in markdown_table(summary)


def test_settings_parse_and_reject_bad_specs() -> None:
    assert parse_setting("target").kind == "target"
    sd = parse_setting("sd")
    assert (sd.kind, sd.rule, sd.threshold) == ("fsd", "reducible", 0.0)
    pure = parse_setting("pure/kl@1.0")
    assert (pure.name, pure.rule, pure.div, pure.threshold) == ("pure/kl@1", "pure", "kl", 1.0)
    assert parse_setting("js@0.25").name == "js@0.25"
    for bad in ("kl", "kl@-1", "kl@nan", "kl@x", "nope/kl@1", "bogus@1"):
        with pytest.raises(ValueError, match="setting"):
            parse_setting(bad)


def test_run_config_mismatch_is_refused(tmp_path: Path) -> None:
    config = {
        "pair": "tiny",
        "num_draft_tokens": 4,
        "max_new_tokens": 8,
        "subset_seed": 0,
        "prompt_format": humaneval.PROMPT_FORMAT,
        "task_ids": ["HumanEval/1"],
    }
    check_run_config(tmp_path / "run.json", config)
    check_run_config(tmp_path / "run.json", {**config, "task_ids": ["HumanEval/1", "HumanEval/2"]})
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_run_config(tmp_path / "run.json", {**config, "max_new_tokens": 16})


# ------------------------------------------------------------------------------ end to end (tiny)


def test_run_is_resumable_on_the_tiny_pair(tmp_path: Path) -> None:
    argv = [
        "--pair",
        "tiny",
        "--limit",
        "2",
        "--settings",
        "target,sd,kl@1.0,pure/kl@1.0",
        "--modes",
        "greedy,sample",
        "--max-new-tokens",
        "8",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--threads",
        "1",
    ]
    first = run(argv)
    samples = tmp_path / "samples.jsonl"
    lines = samples.read_text().splitlines()
    # greedy: 3 settings (pure is skipped: identical to reducible when greedy) x 2 tasks; sample: 4 x 2.
    assert first["generated"] == len(lines) == 14
    keys = {(r["setting"], r["mode"], r["task_id"]) for r in map(json.loads, lines)}
    assert len(keys) == 14
    assert set(first["modes"]) == {"greedy", "sample"}
    assert first["modes"]["greedy"]["settings"]["target"]["n"] == 2
    assert (tmp_path / "summary.json").exists() and (tmp_path / "quality.png").stat().st_size > 0

    before = samples.read_bytes()
    second = run(argv)
    assert second["generated"] == 0
    assert samples.read_bytes() == before

    # A crash mid-write leaves a torn last line: it is dropped and that one sample redone.
    samples.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    third = run(argv)
    assert third["generated"] == 1
    redone = samples.read_text().splitlines()
    assert len(redone) == 14 and all(json.loads(line) for line in redone)
    # Greedy decoding of a seeded setting is deterministic: the redone sample equals the lost one.
    assert json.loads(redone[-1])["completion"] == json.loads(lines[-1])["completion"]


def test_reverse_takes_the_tasks_last_to_first(tmp_path: Path) -> None:
    argv = ["--pair", "tiny", "--limit", "3", "--settings", "sd", "--modes", "greedy", "--max-new-tokens", "4",
            "--no-progress", "--threads", "1"]
    run([*argv, "--out", str(tmp_path / "fwd")])
    run([*argv, "--out", str(tmp_path / "rev"), "--reverse"])
    order = {d: [json.loads(x)["task_id"] for x in (tmp_path / d / "samples.jsonl").read_text().splitlines()]
             for d in ("fwd", "rev")}
    assert order["rev"] == order["fwd"][::-1] and len(set(order["fwd"])) == 3
    # --summary-only on a store missing a setting: no decoding, the summary covers what is there.
    before = (tmp_path / "rev" / "samples.jsonl").read_bytes()
    summary = run([*argv, "--out", str(tmp_path / "rev"), "--settings", "sd,kl@1.0", "--summary-only"])
    assert summary["generated"] == 0 and (tmp_path / "rev" / "samples.jsonl").read_bytes() == before
    assert list(summary["modes"]["greedy"]["settings"]) == ["sd"]
    assert summary["modes"]["greedy"]["settings"]["sd"]["n"] == 3
