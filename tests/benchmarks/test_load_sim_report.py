"""benchmarks/load_sim.py's report of the high phase's TPOT distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.load_sim import high_phase_tpot_ms, tpot_distribution


def test_high_phase_tpot_takes_completed_requests_that_arrived_in_the_high_phase() -> None:
    nan = math.nan
    records = {
        "arrival_s": np.array([10.0, 40.0, 55.0, 79.9, 80.0, 60.0, 70.0]),
        "first_token_s": np.array([10.5, 40.5, 56.0, 80.5, 80.5, 61.0, 71.0]),
        "completion_s": np.array([15.0, 45.2, 60.7, 85.2, 85.0, nan, 71.0]),
        "output_tokens": np.array([48, 48, 48, 48, 48, 48, 1]),
    }
    # Arrivals at 40 and 55 and 79.9 s are in [40, 80); 80 s is not, 60 s never completed, 70 s emitted one token.
    assert high_phase_tpot_ms(records, 40.0) == pytest.approx([4700 / 47, 4700 / 47, 4700 / 47])


def test_tpot_distribution_reports_deciles_and_the_share_within_target() -> None:
    samples = np.arange(1.0, 101.0)  # 1 … 100 ms
    d = tpot_distribution(samples, target_ms=30.0)
    assert d["requests"] == 100 and d["mean"] == 50.5
    assert d["p10"] == pytest.approx(np.percentile(samples, 10), abs=0.05)
    assert d["p50"] == 50.5 and d["p90"] == pytest.approx(90.1, abs=0.05)
    assert d["within_target"] == 0.3
    assert tpot_distribution(np.array([]), 30.0) == {"requests": 0}
