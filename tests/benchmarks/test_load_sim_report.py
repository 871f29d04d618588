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


def test_hindsight_schedule_switches_the_tier_at_the_phase_boundaries() -> None:
    from benchmarks.load_sim import HindsightSchedule, load_slo
    from policies.telemetry import Telemetry

    slo = load_slo("economy", 97.0)
    schedule = HindsightSchedule(slo, "economy", phase_s=40.0, threshold=4.0, k=6)
    seen = {t: schedule.decide(Telemetry(time_s=t, window_s=1.0)) for t in (39.0, 40.0, 79.0, 80.0)}
    assert [(d.thresholds["economy"], d.draft_lengths["economy"]) for d in seen.values()] == [
        (0.0, 0), (4.0, 6), (4.0, 6), (0.0, 0)]
    # The other tiers decode plainly throughout (they carry no traffic on the step load).
    assert all(d.thresholds[n] == 0.0 and d.draft_lengths[n] == 0 for d in seen.values() for n in slo.tiers if n != "economy")
    with pytest.raises(ValueError, match="'premium'"):
        HindsightSchedule(slo, "premium", 40.0, 4.0, 6)


def test_load_sim_reports_a_hindsight_schedule_outside_the_criterion(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "report.json"
    configs = {"plain": {"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "guards": False},
               "hindsight:4:6": {"policy": "hindsight", "high": [4, 6]}, "slo": "slo"}
    subprocess.run([sys.executable, str(root / "benchmarks" / "load_sim.py"), "--rates", "0.1,0.5", "--phase-s", "10",
                    "--tpot-ms", "130", "--seeds", "1", "--configs", json.dumps(configs), "--out", str(out)],
                   check=True, capture_output=True, cwd=root)
    report = json.loads(out.read_text())
    kinds = {c["name"]: c["spec"]["policy"] for c in report["configs"]}
    assert kinds == {"plain": "static", "hindsight:4:6": "hindsight", "slo": "adaptive"}
    assert set(report["criterion"]["held"]) == {"slo"}
    # It ran (4, 6) in the high phase: distortion where plain decoding has none.
    by_name = {c["name"]: c for c in report["configs"]}
    assert by_name["hindsight:4:6"]["mean_distortion_per_token"] > 0.0 == by_name["plain"]["mean_distortion_per_token"]
    # Every high-phase window of the schedule at (4, 6), plain decoding's at (0, 0).
    assert by_name["plain"]["high_phase_points"] == {"0:0": 1.0}
    assert by_name["hindsight:4:6"]["high_phase_points"] == {"4:6": 1.0}
    assert sum(by_name["slo"]["high_phase_points"].values()) == pytest.approx(1.0, abs=0.01)
    # One seed: the same arrivals for every configuration, and the parts' met requests add up to its attainment
    # (#met / #arrivals).
    arrived = by_name["plain"]["requests_by_arrival"]
    assert sum(arrived.values()) > 0
    for c in report["configs"]:
        assert c["requests_by_arrival"] == arrived
        met = sum(a * arrived[part] for part, a in c["attainment_by_arrival"].items() if a is not None)
        assert met / sum(arrived.values()) == pytest.approx(c["slo_attainment"], abs=0.01)


def test_high_phase_plain_share_reads_each_quarter_of_the_high_phase() -> None:
    from benchmarks.load_sim import high_phase_plain_share

    # Windows ending every 5 s over 0 … 115 s; a row at t is the window (t − 5, t], so the high phase (40, 80] holds
    # the rows 45 … 80 and its quarters the rows (40, 50], (50, 60], (60, 70], (70, 80].
    times = [5.0 * i for i in range(24)]
    ks = [0 if t <= 45 or 60 < t <= 65 or t > 80 else 6 for t in times]
    share = high_phase_plain_share({"time_s": times, "k_economy": ks}, "economy", 40.0)
    assert share == [0.5, 0.0, 0.5, 0.0]


def test_high_phase_points_counts_the_high_phase_windows_by_operating_point() -> None:
    from benchmarks.load_sim import high_phase_points

    # The high phase's rows 45 … 80 (eight windows): one plain, four at (2, 6), three at (4, 6); the row at 40 (the
    # light phase's last window) and the one at 85 are outside it.
    times = [5.0 * i for i in range(24)]
    points = [(0.0, 0) if t <= 45 or t > 80 else (2.0, 6) if t <= 65 else (4.0, 6) for t in times]
    got = high_phase_points({"time_s": times, "T_economy": [t for t, _ in points], "k_economy": [k for _, k in points]},
                            "economy", 40.0)
    assert got == {"0:0": 1, "2:6": 4, "4:6": 3}


def test_met_by_arrival_splits_the_requests_by_when_they_arrived() -> None:
    from benchmarks.load_sim import ARRIVAL_PARTS, met_by_arrival

    # Phases of 40 s: light [0, 40), the high phase's quarters [40, 50) … [70, 80), light again from 80 s.
    arrival = np.array([5.0, 39.9, 40.0, 49.9, 55.0, 65.0, 75.0, 79.9, 80.0, 119.0])
    met = np.array([True, False, True, True, False, True, False, False, True, True])
    got = met_by_arrival({"arrival_s": arrival, "slo_met": met}, 40.0)
    assert len(ARRIVAL_PARTS) == got.shape[1] == 6
    assert got[1].tolist() == [2, 2, 1, 1, 2, 2]  # arrived
    assert got[0].tolist() == [1, 2, 0, 1, 0, 2]  # of which met


def test_row_trigger_drafts_from_the_row_count_and_holds_after_the_last_window_that_saw_it() -> None:
    from benchmarks.load_sim import RowTrigger, load_slo, schedule_policy
    from policies.telemetry import Telemetry

    slo = load_slo("economy", 97.0)
    trigger = RowTrigger(slo, "economy", rows=2, hold_s=3.0, threshold=4.0, k=6)
    # Requests per replica over the windows: 1 (plain), 2 (switch), 0, 0 (held), 0 (3 s after: plain), 4 over two replicas.
    seen = [(t, n, r) for t, n, r in ((0.0, 1, 1), (1.0, 2, 1), (2.0, 0, 1), (3.0, 0, 1), (4.0, 0, 1), (5.0, 4, 2))]
    got = [trigger.decide(Telemetry(time_s=t, window_s=1.0, in_flight=n, replicas=r)) for t, n, r in seen]
    assert [(d.thresholds["economy"], d.draft_lengths["economy"]) for d in got] == [
        (0.0, 0), (4.0, 6), (4.0, 6), (4.0, 6), (0.0, 0), (4.0, 6)]
    assert all(d.thresholds[n] == 0.0 and d.draft_lengths[n] == 0 for d in got for n in slo.tiers if n != "economy")
    trigger.reset()  # a new run starts plain
    assert trigger.decide(Telemetry(time_s=6.0, window_s=1.0, in_flight=0)).draft_lengths["economy"] == 0
    with pytest.raises(ValueError, match="got 0, 3.0"):
        RowTrigger(slo, "economy", rows=0, hold_s=3.0, threshold=4.0, k=6)
    with pytest.raises(ValueError, match="'rows'"):
        schedule_policy({"policy": "trigger", "hold_s": 40, "high": [4, 6]}, slo, "economy", 40.0)


def test_step_noise_moves_the_replica_as_a_noise_report_says() -> None:
    """--step-noise: the report's shapes per kind (a batch it did not see takes the nearest one's), the runs'
    spread as each replica's speed, drift and each kind's jitter; a malformed report is refused with what is
    wrong."""
    from benchmarks.load_sim import with_step_noise
    from sim.profile import Profile

    noise = {"plain": {"scale_by_batch": {"1": {"scale": 1.1}, "3": {"scale": 1.3}}, "run_offset": {"sd": 0.08},
                       "drift_sigma": 0.05, "jitter_sigma": 0.3, "drift_tau_s": 4.0},
             "speculative": {"scale_by_batch": {"2": {"scale": 0.95}}}}
    lat = with_step_noise(Profile.default(), noise).latency
    assert lat.speculative_step_jitter_sigma is None  # the plain steps' jitter
    noise["speculative"]["jitter_sigma"] = 0.07
    assert with_step_noise(Profile.default(), noise).latency.speculative_step_jitter_sigma == 0.07
    assert lat.plain_step_scale_by_batch == [1.1, 1.1, 1.3] and lat.speculative_step_scale_by_batch == [0.95, 0.95]
    assert (lat.step_offset_sigma, lat.step_drift_sigma, lat.step_jitter_sigma, lat.step_drift_tau_s) == (
        0.08, 0.05, 0.3, 4.0)
    with pytest.raises(ValueError, match="drift_sigma"):
        with_step_noise(Profile.default(), {"plain": {"scale_by_batch": {}}})
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="prefill scale"):
            with_step_noise(Profile.default(), {**noise, "prefill": {"scale": bad}})


def test_by_seed_judges_each_seed_as_the_live_tally_does_and_pairs_with_the_shipped_policy() -> None:
    """Seed 0: plain decoding meets, so a policy that drafts fails there; seed 1: only T = 4, k = 6 meets, and a
    policy meeting at less distortion holds. The candidate beats the shipped policy on seed 1, ties on seed 0."""
    from benchmarks.load_sim import by_seed, load_slo

    configs = [{"name": n, "spec": {"policy": kind}} for n, kind in
               (("plain", "static"), ("static:4:6", "static"), ("slo", "adaptive"), ("cand", "adaptive"))]
    rows = {"plain": [(1.0, 0.0), (0.8, 0.0)], "static:4:6": [(1.0, 0.15), (1.0, 0.15)],
            "slo": [(1.0, 0.03), (0.9, 0.05)], "cand": [(1.0, 0.0), (0.97, 0.06)]}
    out = by_seed(configs, rows, load_slo("economy", 97.0).tiers["economy"].model_dump())
    assert out is not None
    assert out["seeds"] == 2 and out["held"] == {"slo": 0, "cand": 2}
    cand = out["paired_with_slo"]["cand"]
    assert (cand["wins"], cand["ties"], cand["losses"]) == (1, 1, 0)
    assert cand["attainment_minus_slo"] == pytest.approx(0.035) and cand["distortion_minus_slo"] == pytest.approx(-0.01)
    assert out["each"]["slo"] == [[1.0, 0.03], [0.9, 0.05]]
