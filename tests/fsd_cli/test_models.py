"""``fsd models list|fetch`` through the real CLI entry point (cache pointed at a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsd_cli.main import main


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FSD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_models_list_shows_every_pair_and_status(capsys: pytest.CaptureFixture[str], empty_cache: Path) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "(default)" in lines["smollm2-135m"]
    assert "not fetched (fsd models fetch qwen2.5-coder-1.5b, ~1.6 GB download)" in lines["qwen2.5-coder-1.5b"]
    assert "built in memory" in lines["tiny"]  # the test pair is registered like the others
    assert f"cache: {empty_cache}" in out


def test_models_fetch_unknown_name_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "fetch", "llama-70b"]) == 2
    err = capsys.readouterr().err
    assert "unknown model pair 'llama-70b'" in err and "qwen2.5-coder-1.5b" in err


def test_models_needs_an_action() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["models"])
    assert exc.value.code == 2
