"""The CLI end to end: ``fsd demo --pair tiny`` finishes on its own and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

# Runs the command as a child of a process that is a Linux "child subreaper": daemonised descendants
# (Ray's raylet, GCS, workers) re-parent to it instead of to init. After the command exits, any child
# still alive is something the command left behind — whatever else runs on the machine.
REAPER = r"""
import ctypes, json, os, select, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    print(json.dumps({"error": "prctl failed"}), file=sys.stderr); sys.exit(3)
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=540)
def children():
    out = {}
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            stat = open(f"/proc/{e}/stat").read()
            cmd = open(f"/proc/{e}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out[e] = cmd
    return out
deadline = time.monotonic() + 90  # Ray's processes exit asynchronously after ray.shutdown()
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    left = children()
    remaining = deadline - time.monotonic()
    if not left or remaining <= 0:
        break
    # Wake when one of them exits (a pidfd turns readable), not after a fixed sleep.
    fds = []
    for pid in left:
        try:
            fds.append(os.pidfd_open(int(pid)))
        except ProcessLookupError:  # already gone: reap it on the next pass
            pass
    try:
        select.select(fds, [], [], remaining if fds else 0)
    finally:
        for fd in fds:
            os.close(fd)
print(json.dumps({"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-4000:],
                  "leftover": left}))
"""

ROOT = Path(__file__).resolve().parents[2]


def test_demo_tiny_runs_shows_t_and_leaves_no_processes() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "fsd_cli", "demo", "--pair", "tiny", "--duration", "12", "--requests", "12"]
    wrapper = subprocess.run([sys.executable, "-c", REAPER, *cmd], capture_output=True, text=True, timeout=590,
                             env=env, cwd=ROOT)
    assert wrapper.returncode == 0, wrapper.stderr[-3000:]
    result = json.loads(wrapper.stdout.strip().splitlines()[-1])
    out = result["stdout"]
    assert result["returncode"] == 0, out[-3000:] + result["stderr"]
    assert "T standard" in out and "requests:" in out and "fsd demo: done" in out
    assert " 0 failed" in out, out[-2000:]
    assert not result["leftover"], f"processes left behind by fsd demo: {result['leftover']}"


def test_serve_rejects_a_bad_config_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("control:\n  interval_s: -2\n")
    proc = subprocess.run([sys.executable, "-m", "fsd_cli", "serve", str(bad)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "control.interval_s" in proc.stderr
