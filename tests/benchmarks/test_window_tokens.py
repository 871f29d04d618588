"""benchmarks/window_tokens.py: only windows that ran one (T, k) throughout count (the first window after a change,
and a drafting window that also ran plain steps, do not); the sums and ratios per point and batch bin are the
kept windows' own."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.window_tokens import main


def _entry(t: float, k: int, tokens: int, iters: int, batch: float, distortion: float = 0.1,
           plain_steps: int = 0) -> dict:
    return {"telemetry": {"mean_batch_size": batch, "plain_steps": {"steps": plain_steps},
                          "tiers": {"economy": {"threshold": t, "draft_length": k, "output_tokens": tokens,
                                                "sequence_iterations": iters, "mean_distortion": distortion}}}}


def test_steady_windows_by_point_and_batch(tmp_path: Path) -> None:
    history = [
        _entry(2.0, 6, 70, 10, 2.0),               # first window at T = 2: not steady, dropped
        _entry(2.0, 6, 60, 10, 2.0, 0.2),          # kept, batch <= 2.5
        _entry(2.0, 6, 66, 10, 4.0, 0.1),          # kept, batch 2.5-5.5
        _entry(2.0, 6, 99, 10, 4.0, plain_steps=1),  # ran plain steps too: dropped
        _entry(4.0, 6, 70, 10, 1.0),               # a change: dropped
        _entry(4.0, 6, 68, 10, 1.0, 0.15),         # kept
        {"telemetry": None},                       # a tick without a window breaks the run
        _entry(4.0, 6, 10, 10, 1.0),               # not steady after the gap
    ]
    path = tmp_path / "ticks.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"runs": [{"name": "slo", "round": 0, "history": history}]}).encode()))
    out = tmp_path / "out.json"
    assert main([str(path), "--out", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    t2 = points["T=2,k=6"]
    assert t2["<=2.5"]["windows"] == 1 and t2["<=2.5"]["tokens_per_sequence_iteration"] == 6.0
    assert t2["2.5-5.5"]["tokens_per_sequence_iteration"] == 6.6
    assert t2["all"] == {"windows": 2, "output_tokens": 126, "sequence_iterations": 20,
                         "tokens_per_sequence_iteration": 6.3,
                         "distortion_per_token": round((60 * 0.2 + 66 * 0.1) / 126, 5)}
    assert points["T=4,k=6"]["all"]["windows"] == 1 and points["T=4,k=6"]["all"]["output_tokens"] == 68
    # Keeping the windows with plain steps too adds the dropped one.
    assert main([str(path), "--out", str(out), "--all-windows"]) == 0
    assert json.loads(out.read_text())["points"]["T=2,k=6"]["all"]["windows"] == 3


def test_bad_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--batch-edges '5,2'"):
        main([str(tmp_path / "x.json"), "--batch-edges", "5,2"])
    with pytest.raises(SystemExit, match="x.json"):
        main([str(tmp_path / "x.json")])
