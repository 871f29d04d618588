"""benchmarks/load_batches.py: a load report's requests by the batch they decoded in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.load_batches import analyse, by_batch, decoding_intervals, mean_batches

ROOT = Path(__file__).resolve().parents[2]


def record(arrival_s: float, ttft_ms: float, e2e_ms: float, tpot_ms: float, output: int = 48,
           status: int = 200) -> dict[str, Any]:
    return {"arrival_s": arrival_s, "status": status, "ttft_ms": ttft_ms, "e2e_ms": e2e_ms, "tpot_ms": tpot_ms,
            "output_tokens": output}


def test_mean_batch_is_the_time_average_of_the_requests_decoding_at_once() -> None:
    # A decodes over [0, 4]; B over [2, 4]; C over [3, 7]. A: 2 s alone, 1 s with B, 1 s with B and C:
    # (2·1 + 1·2 + 1·3) / 4 = 1.75. B: 1 s with A, 1 s with A and C: (2 + 3) / 2 = 2.5. C: 1 s with A and B,
    # 3 s alone: (3 + 3) / 4 = 1.5.
    start, end = np.array([0.0, 2.0, 3.0]), np.array([4.0, 4.0, 7.0])
    np.testing.assert_allclose(mean_batches(start, end), [1.75, 2.5, 1.5])


def test_mean_batch_of_disjoint_requests_is_one_and_of_identical_ones_their_count() -> None:
    np.testing.assert_allclose(mean_batches(np.array([0.0, 5.0]), np.array([4.0, 9.0])), [1.0, 1.0])
    np.testing.assert_allclose(mean_batches(np.full(3, 1.0), np.full(3, 2.0)), [3.0, 3.0, 3.0])


def test_a_zero_length_interval_counts_the_requests_open_at_its_instant() -> None:
    np.testing.assert_allclose(mean_batches(np.array([0.0, 1.0]), np.array([2.0, 1.0])), [1.0, 2.0])


def test_mean_batches_rejects_an_interval_that_ends_before_it_starts() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        mean_batches(np.array([2.0]), np.array([1.0]))


def test_decoding_intervals_leave_out_failed_and_short_requests() -> None:
    records = [record(1.0, 200.0, 3200.0, 60.0), record(2.0, 100.0, 600.0, 50.0, output=4),
               record(3.0, 0.0, 0.0, 0.0, status=503), {"arrival_s": 4.0, "status": 200}]
    start, end, tpot = decoding_intervals(records, min_tokens=8)
    np.testing.assert_allclose(start, [1.2])
    np.testing.assert_allclose(end, [4.2])
    np.testing.assert_allclose(tpot, [60.0])
    with pytest.raises(ValueError, match="min_tokens must be >= 2, got 1"):
        decoding_intervals(records, min_tokens=1)


def test_by_batch_bins_to_the_nearest_row_with_the_share_meeting_the_target() -> None:
    rows = by_batch(np.array([1.2, 0.6, 2.4, 2.6]), np.array([50.0, 60.0, 90.0, 110.0]), target_ms=100.0)
    assert [r["batch"] for r in rows] == [1, 2, 3]
    assert [r["requests"] for r in rows] == [2, 1, 1]
    assert rows[0]["tpot_p50_ms"] == 55.0 and rows[0]["meeting_target"] == 1.0
    assert rows[2]["meeting_target"] == 0.0


def test_analyse_pools_one_configuration_over_reports_and_rounds() -> None:
    def report(offset: float) -> dict[str, Any]:
        runs = [{"name": "plain", "round": r, "records": [record(offset, 0.0, 2000.0, 60.0 + r),
                                                        record(offset + 1.0, 0.0, 2000.0, 80.0 + r)]}
                for r in range(2)]
        runs.append({"name": "slo", "round": 0, "records": [record(0.0, 0.0, 1000.0, 40.0)]})
        return {"configs": [{"name": "plain", "tpot_target_ms": 97.0}], "runs": runs}

    result = analyse([report(0.0), report(10.0)], config="plain")
    assert result["tpot_target_ms"] == 97.0
    assert list(result["configs"]) == ["plain"]
    # Each pair overlaps half its life: mean batch 1.5 for both, which rounds to 2 (numpy: half to even).
    (row,) = result["configs"]["plain"]
    assert row["batch"] == 2 and row["requests"] == 8
    with pytest.raises(ValueError, match="no run of configuration 'static:4:6'"):
        analyse([report(0.0)], config="static:4:6")


def test_the_script_reads_a_shipped_report_and_prints_json(tmp_path: Path) -> None:
    report = ROOT / "docs" / "img" / "load_economy_s29_t97_s25.json"
    out = tmp_path / "batches.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_batches.py"), str(report),
                           "--config", "plain", "--min-tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    rows = printed["configs"]["plain"]
    assert sum(r["requests"] for r in rows) > 0
    assert all(0.0 <= r["meeting_target"] <= 1.0 for r in rows)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_batches.py"), str(tmp_path / "none.json")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "load_batches:" in bad.stderr
