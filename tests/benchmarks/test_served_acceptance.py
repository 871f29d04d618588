"""``benchmarks/served_acceptance.py``: a service's requests by operating point against profiles' predictions."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import served_acceptance  # noqa: E402
from sim.profile import DEFAULT_PROFILE_PATH, Profile  # noqa: E402


def _sample(t_s: float, threshold: float, k: int) -> dict[str, Any]:
    return {"t_s": t_s, "thresholds": {"economy": threshold}, "draft_lengths": {"economy": k}}


def _record(arrival_s: float, e2e_ms: float, drafted: int, accepted: int, distortion: float,
            tokens: int = 40, status: int = 200) -> dict[str, Any]:
    return {"arrival_s": arrival_s, "status": status, "ttft_ms": 200.0, "e2e_ms": e2e_ms, "output_tokens": tokens,
            "fsd": {"tier": "economy", "drafted_tokens": drafted, "accepted_tokens": accepted,
                    "mean_distortion": distortion}}


def test_only_requests_that_lived_at_one_point_are_counted() -> None:
    samples = [_sample(0.0, 0.0, 4), _sample(10.0, 0.5, 4), _sample(20.0, 0.5, 6), _sample(30.0, 0.0, 0)]
    records = [
        _record(1.0, 5000.0, 40, 30, 0.0),  # decodes 1.2–6 s: T = 0, k = 4
        _record(2.0, 4000.0, 44, 26, 0.0),  # 2.2–6 s: T = 0, k = 4
        _record(8.0, 5000.0, 40, 35, 0.05),  # 8.2–13 s: spans the change at 10 s, left out
        _record(11.0, 5000.0, 42, 40, 0.1),  # 11.2–16 s: T = 0.5, k = 4
        _record(12.0, 5000.0, 42, 40, 0.1, status=500),  # not answered
        _record(31.0, 5000.0, 0, 0, 0.0),  # k = 0: drafts nothing
    ]
    report = {"runs": [{"name": "slo", "round": 0, "t_samples": samples, "records": records}]}
    served = served_acceptance.served_points([report], "economy")
    assert set(served) == {(0.0, 4), (0.5, 4)}
    assert served[(0.0, 4)] == {"requests": 2, "drafted": 84, "accepted": 56, "tokens": 80, "distortion": 0.0}
    assert served[(0.5, 4)]["requests"] == 1 and served[(0.5, 4)]["distortion"] == pytest.approx(4.0)


def test_a_profile_is_compared_at_the_points_served(tmp_path: Path) -> None:
    """Requests drawn at the shipped profile's own acceptance: its error is sampling noise only, and a profile
    whose acceptance is shifted by 0.1 is that far off at every point."""
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    rng = np.random.default_rng(3)
    samples, records = [], []
    for i, (t, k) in enumerate([(0.0, 4), (0.25, 6), (1.0, 4)]):
        samples.append(_sample(100.0 * i, t, k))
        rate = profile.expected_acceptance_rate("kl", t, k)
        for j in range(40):
            drafted = 400
            records.append(_record(100.0 * i + 2.0 * j + 1.0, 1500.0, drafted, int(rng.binomial(drafted, rate)),
                                   profile.mean_distortion("kl", t, k)))
    report = {"runs": [{"name": "slo", "round": 0, "t_samples": samples, "records": records}]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    out_path = tmp_path / "out.json"
    assert served_acceptance.main([str(path), "--profile", f"shipped={DEFAULT_PROFILE_PATH}",
                                   "--out", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    assert [(p["T"], p["k"], p["requests"]) for p in out["points"]] == [(0.0, 4, 40), (0.25, 6, 40), (1.0, 4, 40)]
    errors = out["errors"]["shipped"]
    assert errors["accepted_share_mean_abs_error"] < 0.01  # 16,000 drafts a point: noise ~0.004
    assert errors["distortion_mean_abs_error"] == pytest.approx(0.0, abs=1e-9)
    assert errors["points_accepted_share_within_0.02"] == 3

    shifted = served_acceptance.compare(
        {key: {**v, "accepted": v["accepted"] - 0.1 * v["drafted"]}
         for key, v in served_acceptance.served_points([report], "economy").items()},
        {"shipped": profile}, "kl")
    assert shifted["errors"]["shipped"]["accepted_share_mean_abs_error"] == pytest.approx(0.1, abs=0.01)


def test_bad_profile_items_are_errors_naming_them(capsys) -> None:
    with pytest.raises(SystemExit):
        served_acceptance.main(["x.json", "--profile", "no-path"])
    assert "--profile 'no-path'" in capsys.readouterr().err
