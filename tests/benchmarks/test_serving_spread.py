"""``benchmarks/serving_spread.py``: the per-request acceptance spread fitted from a service's own requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import serving_spread  # noqa: E402
from sim.profile import DEFAULT_PROFILE_PATH, Profile, RequestAcceptance, shifted_acceptance  # noqa: E402


def test_operating_point_of_a_request_is_time_weighted() -> None:
    """T read as a step function over the decode span; rows = the mean count of spans decoding, itself in."""
    samples = [{"t_s": 0.0, "thresholds": {"standard": 0.0}}, {"t_s": 2.0, "thresholds": {"standard": 1.0}}]
    spans = np.array([[1.0, 3.0], [0.0, 1.5], [2.5, 2.5]])
    assert serving_spread.mean_threshold(spans, samples, "standard").tolist() == pytest.approx([0.5, 0.0, 1.0])
    rows = serving_spread.mean_rows(np.array([[0.0, 2.0], [1.0, 3.0], [10.0, 11.0]]))
    assert rows.tolist() == pytest.approx([1.5, 1.5, 1.0])


def _report(profile_path: Path, kappa: float, n: int, seed: int,
            levels: tuple[float, ...] = (0.0, 0.1, 0.2)) -> dict[str, Any]:
    """A fidelity report's real leg drawn from the model: one request at a time (rows 1), T held per request
    at one of ``levels``, each request's acceptance the profile's at its T shifted by a Beta(κ/2, κ/2) log-odds."""
    profile = Profile.load(profile_path)
    rng = np.random.default_rng(seed)
    thresholds = rng.choice(levels, size=n)
    base = np.array([profile.expected_acceptance_rate("kl", float(t), 4, batch=1.0) for t in thresholds])
    odds = RequestAcceptance(concentration=kappa).draw_odds_scales(rng, n)
    drafted = rng.integers(40, 121, size=n)
    accepted = rng.binomial(drafted, shifted_acceptance(base, odds))
    records = [{"i": i, "arrival_s": 10.0 * i, "status": 200, "ttft_ms": 500.0, "e2e_ms": 5000.0, "output_tokens": 40,
                "fsd": {"accepted_tokens": int(accepted[i]), "drafted_tokens": int(drafted[i])}} for i in range(n)]
    samples = [{"t_s": 10.0 * i, "thresholds": {"standard": float(thresholds[i])}} for i in range(n)]
    return {"benchmark": "fidelity", "profile": str(profile_path),
            "settings": {"tier": "standard", "div": "kl", "k": 4},
            "scenarios": [{"name": "steady", "real": {"records": records, "t_samples": samples}}]}


def test_fit_recovers_the_spread_and_writes_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "fidelity.json"
    report.write_text(json.dumps(_report(DEFAULT_PROFILE_PATH, kappa=5.0, n=500, seed=7)))
    out = tmp_path / "profile.json"
    assert serving_spread.main([str(report), "--profile-out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    kappa = result["request_acceptance"]["concentration"]
    assert kappa == pytest.approx(5.0, rel=0.3)
    (scenario,) = result["per_scenario"]
    assert scenario["requests"] == 500 and scenario["mean_rows"] == pytest.approx(1.0)
    written = Profile.load(out)
    assert written.request_acceptance is not None and written.request_acceptance.concentration == kappa
    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    assert written.acceptance == shipped.acceptance and written.latency == shipped.latency


def test_bad_reports_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "load"}))
    assert serving_spread.main([str(other)]) == 2
    assert "not a fidelity report" in capsys.readouterr().err
    assert serving_spread.main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    # Requests that differ by sampling noise alone: no spread to write (seed 5), or a κ far above any served one.
    for seed, found in ((5, False), (3, True)):
        path = tmp_path / f"flat{seed}.json"
        path.write_text(json.dumps(_report(DEFAULT_PROFILE_PATH, kappa=1e6, n=300, seed=seed)))
        written = tmp_path / f"p{seed}.json"
        code = serving_spread.main([str(path), "--profile-out", str(written)])
        captured = capsys.readouterr()
        if found:
            assert code == 0 and Profile.load(written).request_acceptance.concentration > 50  # type: ignore[union-attr]
        else:
            assert code == 2 and "no spread beyond sampling noise" in captured.err and not written.exists()


def test_saturated_operating_points_are_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Requests at a T where the profile accepts every draft (rate exactly 1: T = 2 on the shipped profile) carry
    no spread to measure: they are left out, and the others still give κ."""
    assert Profile.load(DEFAULT_PROFILE_PATH).expected_acceptance_rate("kl", 2.0, 4, batch=1.0) == 1.0
    report = tmp_path / "fidelity.json"
    report.write_text(json.dumps(_report(DEFAULT_PROFILE_PATH, kappa=5.0, n=500, seed=7, levels=(0.0, 0.1, 2.0))))
    assert serving_spread.main([str(report)]) == 0
    result = json.loads(capsys.readouterr().out)
    saturated = sum(1 for s in _report(DEFAULT_PROFILE_PATH, 5.0, 500, 7, (0.0, 0.1, 2.0))["scenarios"][0]["real"]["t_samples"]
                    if s["thresholds"]["standard"] == 2.0)
    assert f"over {500 - saturated} requests of 500" in result["request_acceptance"]["source"]
    assert result["request_acceptance"]["concentration"] == pytest.approx(5.0, rel=0.35)
