"""benchmarks/decision_candidates.py on a ticks file: the recorded spec replays without a difference, a candidate
that decides otherwise is reported from its first differing tick; a bad candidate is refused by name."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.decision_candidates import main
from policies.slo import SLOSpec
from tests.sim.conftest import recorded_history


def test_candidates_on_a_ticks_file(tmp_path: Path) -> None:
    path = tmp_path / "ticks.json.gz"
    history = recorded_history({"policy": "slo"}, SLOSpec.default())
    path.write_bytes(gzip.compress(json.dumps({"runs": [{"name": "slo", "round": 0, "history": history}]}).encode()))
    out = tmp_path / "out.json"
    assert main([str(path), "--tier", "standard", "--burst-s", "60", "--out", str(out),
                 "--candidate", 'plain={"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "guards": false}']) == 0
    rows = json.loads(out.read_text())["runs"]["slo:0"]
    assert rows["recorded"]["first_difference_s"] is None
    assert rows["plain"]["first_difference_s"] is not None
    assert rows["plain"]["first_draft_from_burst_s"] is None and rows["plain"]["light_phase_lossy"] == []
    assert all(t > 0 and k > 0 and s < 60 for s, t, k in rows["recorded"]["light_phase_lossy"])
    # The high phase's counts, from the recorded decisions themselves (the recorded spec replays them exactly).
    decided = [e for e in history if e.get("decision")]
    burst = [(e["decision"]["thresholds"]["standard"], e["decision"]["draft_lengths"]["standard"]) for e in decided
             if e["time_s"] - decided[0]["time_s"] >= 60]
    assert rows["plain"]["burst_lossy_ticks"] == 0 and rows["plain"]["burst_relaxes"] == 0
    assert rows["recorded"]["burst_lossy_ticks"] == sum(1 for t, k in burst if k and t > 0)
    assert rows["recorded"]["burst_relaxes"] == sum(1 for (t0_, k0), (t1, k1) in zip(burst, burst[1:], strict=False)
                                                    if k0 and (k1 < k0 or t1 < t0_))
    with pytest.raises(SystemExit, match="--candidate 'recorded=.*the recorded spec's row"):
        main([str(path), "--burst-s", "60", "--candidate", 'recorded={"policy": "slo"}'])
