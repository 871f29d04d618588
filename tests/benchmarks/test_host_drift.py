"""benchmarks/host_drift.py: runs whose steps took 1.3x as long (a slower host) read log 1.3 above the others in their
plain steps' offset, the policy's difference from the static runs, the pooled split by verdict and the slope of
attainment on offset across a configuration's rounds follow, a run's
attainment is scored as benchmarks/load.py scores a round, and a report without its ticks file is refused by name."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.host_drift import main
from tests.benchmarks.test_step_ratios import _noisy_windows


def _history(windows: list[dict], scale: float) -> list[dict]:
    """A ticks history of ``windows`` (no policy event: the default model), every step ``scale`` times as long."""
    out = []
    for i, telemetry in enumerate(windows):
        tel = json.loads(json.dumps(telemetry))
        for kind in ("plain_steps", "speculative_steps"):
            if tel.get(kind):
                tel[kind]["ms"] *= scale
        out.append({"time_s": float(i), "telemetry": tel, "decision": None})
    return out


def test_slow_policy_runs_read_as_a_slower_host(tmp_path: Path) -> None:
    windows, _ = _noisy_windows({}, 7, duration_s=600.0)
    ok = {"status": 200, "e2e_ms": 4000.0, "ttft_ms": 300.0}
    met, missed = {**ok, "tpot_ms": 80.0}, {**ok, "tpot_ms": 150.0}
    runs = [("plain", 0, 1.0, [met] * 4), ("static:4:6", 0, 1.0, [met] * 3 + [missed]),
            ("slo", 0, 1.3, [met] + [missed] * 3), ("slo", 1, 1.1, [met, met, missed, missed]),
            ("slo", 2, 1.2, [met, met, missed, missed])]
    report = {
        "seed": 3,
        "configs": [{"name": n, "spec": s, "tpot_target_ms": 97.0, "ttft_target_ms": 4000.0} for n, s in (
            ("plain", {"policy": "static"}), ("static:4:6", {"policy": "static"}), ("slo", {"policy": "slo"}))],
        "runs": [{"name": n, "round": r, "records": recs, "t_samples": []} for n, r, _, recs in runs],
        "criterion": {"held": {"slo": False}},
    }
    path = tmp_path / "load_s3.json"
    path.write_text(json.dumps(report))
    ticks = {"runs": [{"name": n, "round": r, "history": _history(windows, scale)} for n, r, scale, _ in runs]}
    (tmp_path / "load_s3_ticks.json.gz").write_bytes(gzip.compress(json.dumps(ticks).encode()))
    machine = {"plain": {"scale_by_batch": {str(b): {"scale": 1.0} for b in range(1, 9)}}}
    noise, out = tmp_path / "noise.json", tmp_path / "out.json"
    noise.write_text(json.dumps({"noise": machine}))

    assert main([str(path), "--against", str(noise), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    one = result["reports"][0]
    by_run = {r["run"]: r for r in one["runs"]}
    assert by_run["slo:0"]["plain_offset"] - by_run["plain:0"]["plain_offset"] == pytest.approx(math.log(1.3), abs=1e-3)
    assert [by_run[k]["slo_attainment"] for k in ("plain:0", "static:4:6:0", "slo:0", "slo:1", "slo:2")] == \
        [1.0, 0.75, 0.25, 0.5, 0.5]
    slo_mean = (math.log(1.3) + math.log(1.1) + math.log(1.2)) / 3
    assert one["policy_minus_static_plain_offset"] == pytest.approx(slo_mean, abs=1e-3)
    assert one["configs"]["slo"]["held"] is False and one["configs"]["plain"]["static"] is True
    assert one["corr_plain_offset_attainment"] < -0.8  # the slow runs are the ones that missed
    pooled = result["pooled"]
    assert pooled["not_held"]["reports"] == 1 and pooled["not_held"]["slower_than_static"] == 1
    assert pooled["held"]["reports"] == 0
    # Only slo ran more than once: its rounds at 1.3x, 1.1x and 1.2x the steps reached 0.25, 0.5 and 0.5; the slope is
    # the least-squares line through their deviations from its own means (one group: 3 - 1 - 1 degrees of freedom).
    x = np.log([1.3, 1.1, 1.2]) - np.log([1.3, 1.1, 1.2]).mean()
    y = np.array([0.25, 0.5, 0.5]) - np.mean([0.25, 0.5, 0.5])
    slope = pooled["within_config_slope"]
    assert slope["runs"] == 3 and slope["groups"] == 1
    assert slope["attainment_per_log_offset"] == pytest.approx(float(x @ y / (x @ x)), rel=1e-2)
    resid = y - (x @ y / (x @ x)) * x
    assert slope["ci95"] == pytest.approx(1.96 * math.sqrt(float(resid @ resid) / 1 / float(x @ x)), rel=1e-2)

    (tmp_path / "load_s3_ticks.json.gz").unlink()
    with pytest.raises(SystemExit, match="load_s3.json"):
        main([str(path), "--against", str(noise)])


def test_a_run_s_first_windows_and_a_kind_with_few_windows_give_no_offset() -> None:
    """A run's first two windows can hold the run before it: left out. A kind with fewer than five windows left gets
    its count and no offset (one window is a step or two, not the host's speed)."""
    from benchmarks.step_ratios import run_offsets
    from policies.operating_model import DEFAULT_MODEL_PATH, OperatingModel

    windows, _ = _noisy_windows({}, 8, duration_s=600.0)
    plain = [w for w in windows if (w.get("plain_steps") or {}).get("steps", 0) >= 4]
    machine = {"plain": {"scale_by_batch": {str(b): {"scale": 1.0} for b in range(1, 9)}}}
    model = OperatingModel.load(DEFAULT_MODEL_PATH)
    slow_first = _history(plain[:2], 5.0) + _history(plain[2:], 1.0)  # the run before, 5x slower, in two windows
    rest = run_offsets([e["telemetry"] for e in _history(plain[2:], 1.0)], model, machine, skip=0)["plain"]
    skipped = run_offsets([e["telemetry"] for e in slow_first], model, machine)["plain"]
    assert rest["windows"] >= 5 and skipped == rest  # the slow windows left out, the rest read as they are
    kept = run_offsets([e["telemetry"] for e in slow_first], model, machine, skip=0)["plain"]
    assert kept["offset"] > skipped["offset"] + 0.01  # read in, the run before's windows would slow this one
    few = run_offsets([e["telemetry"] for e in _history(plain[:6], 1.0)], model, machine)["plain"]
    assert "offset" not in few and few["windows"] <= 4
