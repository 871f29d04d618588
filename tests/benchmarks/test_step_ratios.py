"""benchmarks/step_ratios.py on a ticks file: on a simulated history whose recorded operating model is the profile
the simulator ran (steps as the profile models them), every kind of step measures what the model says at every
batch, so the script forms the model's step as the policy does; a window's ratio is measured / modelled; an
unreadable file is refused by name."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.step_ratios import main, window_ratios
from policies.mpc import DEFAULT_MODEL_PATH, OperatingModel
from policies.slo import SLOSpec
from tests.sim.conftest import recorded_history


def test_a_simulated_history_measures_its_own_model(tmp_path: Path) -> None:
    path = tmp_path / "ticks.json.gz"
    history = recorded_history({"policy": "slo"}, SLOSpec.default())
    path.write_bytes(gzip.compress(json.dumps({"runs": [{"name": "slo", "round": 0, "history": history}]}).encode()))
    out = tmp_path / "out.json"
    assert main([str(path), "--out", str(out)]) == 0
    kinds = json.loads(out.read_text())["files"][str(path)]
    assert len([k for k in kinds if k.startswith("k")]) >= 2, kinds  # several k_max, several batches each
    assert sum(len(by_batch) for by_batch in kinds.values()) >= 4, kinds
    for kind, by_batch in kinds.items():
        for batch, cell in by_batch.items():
            assert cell["windows"] > 0 and cell["min"] == cell["max"] == pytest.approx(1.0, abs=1e-3), (kind, batch)


def test_a_window_ratio_is_measured_over_modelled() -> None:
    model = OperatingModel.load(DEFAULT_MODEL_PATH)
    fixed, per_row = model.cost.plain_line(2.0)
    modelled = float(fixed + per_row * 2.0)
    ((kind, batch, ratio),) = window_ratios({"plain_steps": {"steps": 10, "rows": 20, "ms": 10 * 1.3 * modelled}},
                                            model)
    assert (kind, batch) == ("plain", 2.0) and ratio == pytest.approx(1.3)
    assert window_ratios({"plain_steps": {"steps": 0, "rows": 0, "ms": 0.0}}, model) == []


def test_an_unreadable_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="step_ratios: history file"):
        main([str(path)])
