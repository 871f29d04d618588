"""benchmarks/acceptance_by_batch.py --batch-profile-out: the fitted sections go into the profile at the path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.acceptance_by_batch import _write_batch_profile
from sim.profile import DEFAULT_PROFILE_PATH, Profile


def _acceptance(seed: int) -> list[dict[str, Any]]:
    """Two (batch, T) groups of 12 requests each, acceptance about 0.6 with a per-request spread."""
    rng = np.random.default_rng(seed)
    groups = []
    for batch, threshold in ((1, 0.0), (8, 0.0)):
        drafted = rng.integers(40, 60, size=12)
        accepted = rng.binomial(drafted, rng.beta(6, 4, size=12))
        groups.append({"batch": batch, "threshold": threshold, "row_iterations": 200,
                       "tokens_per_row_iteration": 3.1, "request_accepted": accepted.tolist(),
                       "request_drafted": drafted.tolist()})
    return groups


def test_a_fresh_calibration_at_the_path_keeps_its_latency(tmp_path: Path) -> None:
    # The documented workflow: `fsd calibrate --out P`, then this script with --batch-profile-out P.
    # Writing the shipped profile there would silently replace that calibration with another machine's.
    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    mine = shipped.model_copy(update={"latency": shipped.latency.model_copy(update={"plain_step_a_ms": 12.5})})
    path = tmp_path / "mine.json"
    mine.save(str(path))

    out = _write_batch_profile(_acceptance(0), str(path), "test", sections=("request_acceptance",))

    written = Profile.load(str(path))
    assert written.latency.plain_step_a_ms == 12.5
    assert out["sections_written"] == ["request_acceptance"]
    assert written.request_acceptance is not None
    assert written.request_acceptance.source.endswith("test")


def test_without_a_profile_at_the_path_the_shipped_one_is_the_base(tmp_path: Path) -> None:
    path = tmp_path / "new.json"
    _write_batch_profile(_acceptance(1), str(path), "test", sections=("request_acceptance",))
    written = Profile.load(str(path))
    assert written.latency == Profile.load(DEFAULT_PROFILE_PATH).latency
    assert written.request_acceptance is not None
    assert written.request_acceptance.source.endswith("test")


def test_kappa_alone_needs_no_reference_batch(tmp_path: Path) -> None:
    # A run at the small batches a service runs at (session 28: batches 1 and 2 at T = 0, 0.25, 0.5) fits κ; the
    # batch multipliers are relative to batch 8, which it did not measure: they are left out, not an error.
    small = [g for g in _acceptance(2) if g["batch"] == 1]
    small.append({**small[0], "batch": 2})
    path = tmp_path / "kappa.json"
    out = _write_batch_profile(small, str(path), "test", sections=("request_acceptance",))
    assert out["odds_scale"] is None and out["sections_written"] == ["request_acceptance"]
    written = Profile.load(str(path))
    assert written.request_acceptance is not None
    assert written.batch_acceptance == Profile.load(DEFAULT_PROFILE_PATH).batch_acceptance
    # Asked for the batch section, the missing reference batch is named.
    with pytest.raises(ValueError, match="reference batch 8"):
        _write_batch_profile(small, str(tmp_path / "both.json"), "test")
