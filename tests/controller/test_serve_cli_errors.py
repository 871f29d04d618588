"""``fsd serve`` refuses what cannot work with one line and exit code 2, before Ray starts.

Two cases run the real CLI in a subprocess (bounded: a regression would start a cluster and hit the
timeout, or print a traceback); the rest call the same ``main`` in-process, with ``Service.start``
replaced by a tripwire so a missing check fails the test instead of starting Ray.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.controller.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
CLI_MODULE = "fsd_cli"  # the `fsd` entry point's module


def fsd_serve(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", CLI_MODULE, "serve", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def assert_one_line_error(returncode: int, stderr: str, *needles: str) -> str:
    assert returncode == 2, (returncode, stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("fsd serve: error: "), lines[0]
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def serve_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    import importlib

    from controller import runtime

    def tripwire(self: object, *args: object, **kwargs: object) -> str:
        raise AssertionError("fsd serve got as far as starting Ray: a pre-flight check is missing")

    monkeypatch.setattr(runtime.Service, "start", tripwire)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    main = importlib.import_module(f"{CLI_MODULE}.main").main

    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["serve", *argv])
        return code, capsys.readouterr().err

    return run


# ---- the real CLI, in a subprocess -----------------------------------------------------------------


def test_missing_config_subprocess(tmp_path: Path) -> None:
    r = fsd_serve("nope.yaml", cwd=tmp_path)
    assert_one_line_error(r.returncode, r.stderr, "nope.yaml", "does not exist")


def test_busy_port_subprocess(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        r = fsd_serve("--pair", "tiny", "--port", str(port), cwd=tmp_path)
    line = assert_one_line_error(r.returncode, r.stderr, str(port))
    assert "not available" in line and "--port" in line


# ---- the same main(), in-process -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "content", "needles"), [
    ("bad-syntax.yaml", "model:\n  pair: [unclosed\nslo: {\n", ("not valid YAML",)),
    ("bad-key.yaml", "model:\n  pairr: tiny\n", ("model.pairr",)),
    ("bad-value.yaml", "control:\n  interval_s: -1\n", ("control.interval_s",)),
    ("not-a-mapping.yaml", "- a\n- b\n", ("mapping",)),
    ("latin1.yaml", b"model:\n  pair: caf\xe9\n", ("not valid YAML",)),
])
def test_invalid_config_is_one_line(serve_in_process, tmp_path: Path, name: str,  # type: ignore[no-untyped-def]
                                    content: str | bytes, needles: tuple[str, ...]) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    assert_one_line_error(*serve_in_process(str(path)), name, *needles)


def test_config_directory(serve_in_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert_one_line_error(*serve_in_process(str(tmp_path)), "is a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_config(serve_in_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "secret.yaml"
    path.write_text("model: {pair: tiny}\n", encoding="utf-8")
    path.chmod(0)
    assert_one_line_error(*serve_in_process(str(path)), "secret.yaml", "not readable")


def test_missing_model_pairs(serve_in_process, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    port = str(free_port())
    assert_one_line_error(*serve_in_process("--pair", "gpt-17", "--port", port), "gpt-17", "known pairs")
    # An empty model cache: the shipped Qwen pair is known but not fetched, and the error says how to fetch it.
    monkeypatch.setenv("FSD_CACHE_DIR", str(tmp_path / "cache"))
    assert_one_line_error(*serve_in_process("--pair", "qwen2.5-coder-1.5b", "--port", port),
                          "qwen2.5-coder-1.5b", "not fetched", "fsd models fetch")
    assert_one_line_error(*serve_in_process("--pair", "/no/such/target,/no/such/draft", "--port", port),
                          "/no/such/target", "local Hugging Face cache")


def test_vllm_engine_without_its_environment(serve_in_process, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "vllm.yaml"
    path.write_text(f"vllm:\n  python: {tmp_path / 'no-venv' / 'python'}\n", encoding="utf-8")
    assert_one_line_error(*serve_in_process(str(path), "--engine", "vllm", "--port", str(free_port())),
                          "no vLLM environment", "make vllm-env")
    assert_one_line_error(*serve_in_process("--pair", "tiny", "--engine", "vllm", "--port", str(free_port())),
                          "model.engine 'vllm'", "pair 'tiny'", "vllm.target_dir")
