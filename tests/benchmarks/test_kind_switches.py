"""benchmarks/kind_switches.py: switches of the kind of step are counted per run, those made while probing apart, and a
probe switched back at the very next decision counts as undone; a static point's run is left out; an unreadable
file is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.kind_switches import count_switches, main


def _entry(k: int | None, reason: str = "mpc best effort") -> dict:
    decision = None if k is None else {"draft_lengths": {"economy": k}, "reason": reason}
    return {"time_s": 0.0, "decision": decision, "telemetry": {}}


def test_switches_probes_and_probes_undone_are_counted() -> None:
    kinds = [(True, ""), (False, "probing speculative steps"), (True, ""),  # a probe undone at once
             (False, "probing speculative steps"), (False, ""), (True, ""),  # a probe that held a tick
             (True, ""), (False, "")]
    assert count_switches(kinds) == {"decisions": 8, "switches": 5, "probe_switches": 2, "probes_undone_next_tick": 1,
                                     "best_effort_decisions": 0}
    assert count_switches([(True, "mpc best effort: batch 1"), (True, "mpc meets: batch 1")])["best_effort_decisions"] == 1
    assert count_switches([]) == {"decisions": 0, "switches": 0, "probe_switches": 0, "probes_undone_next_tick": 0,
                                  "best_effort_decisions": 0}


def test_a_ticks_file_is_read_per_run_and_static_points_are_left_out(tmp_path: Path) -> None:
    static_event = {"time_s": 0.0, "event": {"kind": "policy", "policy": {"policy": "static", "thresholds": 0.0}}}
    slo_event = {"time_s": 0.0, "event": {"kind": "policy", "policy": {"policy": "slo"}}}
    runs = [
        {"name": "plain", "round": 0, "history": [static_event, _entry(0), _entry(0)]},
        {"name": "slo", "round": 0, "history": [slo_event, _entry(0), _entry(6, "mpc: probing speculative steps"),
                                                  _entry(0), _entry(None), _entry(0)]},
    ]
    path, out = tmp_path / "ticks.json", tmp_path / "out.json"
    path.write_text(json.dumps({"runs": runs}))
    assert main([str(path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["files"][str(path)]) == ["slo:0"]
    assert result["total"] == {"runs": 1, "decisions": 4, "switches": 2, "probe_switches": 1,
                               "probes_undone_next_tick": 1, "best_effort_decisions": 3}
    with pytest.raises(SystemExit, match="missing"):
        main([str(tmp_path / "missing.json")])
