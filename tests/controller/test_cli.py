"""The CLI end to end: ``fsd demo --pair tiny`` finishes on its own and leaves no Ray process behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

RAY_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "default_worker.py", "dashboard", "log_monitor")


def _ray_processes() -> set[int]:
    """PIDs of Ray processes on this machine (read from /proc, so no extra dependency)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd for m in RAY_PROCESS_MARKERS):
            pids.add(int(entry))
    return pids


def test_demo_tiny_runs_shows_t_and_leaves_no_processes() -> None:
    before = _ray_processes()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "demo", "--pair", "tiny", "--duration", "12", "--requests", "12"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "T standard" in out and "requests:" in out and "fsd demo: done" in out
    assert " 0 failed" in out, out[-2000:]
    leftover = _ray_processes() - before
    assert not leftover, f"processes left behind by fsd demo: {sorted(leftover)}"


def test_serve_rejects_a_bad_config_naming_the_field(tmp_path: object) -> None:
    from pathlib import Path

    bad = Path(str(tmp_path)) / "bad.yaml"
    bad.write_text("control:\n  interval_s: -2\n")
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "serve", str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "control.interval_s" in proc.stderr
