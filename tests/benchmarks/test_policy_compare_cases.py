"""benchmarks/policy_compare.py's case sizing: the rule that matches calibrated-profile cases to the
hand-made ones (held-out sets E and F) is a function of the two profiles and the trace alone."""

from __future__ import annotations

import pytest

from benchmarks.policy_compare import HELDOUT_SETS, MATCHED_SETS, TRACES, heldout_cases, matched_scales
from sim.profile import DEFAULT_PROFILE_PATH, HANDMADE_2THREADS_PROFILE_PATH, Profile


def test_matched_scales_are_the_profiles_phase_ratios() -> None:
    cal, hand = Profile.load(DEFAULT_PROFILE_PATH), Profile.load(HANDMADE_2THREADS_PROFILE_PATH)
    assert matched_scales(hand, hand, 1000.0, 100.0) == pytest.approx((1.0, 1.0, 1.0))
    load, ttft, tpot = matched_scales(cal, hand, 1000.0, 100.0)
    cal_a, cal_b = cal.latency.plain_coeffs()
    hand_a, hand_b = hand.latency.plain_coeffs()
    assert ttft == pytest.approx(cal.latency.prefill_ms(1000) / hand.latency.prefill_ms(1000))
    assert tpot == pytest.approx((cal_a + cal_b) / (hand_a + hand_b))
    # Slower replicas get proportionally less load: the service time of the median request, inverted.
    cal_service, hand_service = (p.latency.prefill_ms(1000) + 100 * sum(p.latency.plain_coeffs()) for p in (cal, hand))
    assert load == pytest.approx(hand_service / cal_service)
    assert (load < 1.0) == (cal_service > hand_service)  # the slower profile's replicas get less load


@pytest.mark.parametrize("which", sorted(MATCHED_SETS))
def test_matched_sets_scale_only_the_calibrated_cases(which: str) -> None:
    trace = TRACES / f"azure_llm_2023_{HELDOUT_SETS[which][0]}.csv"
    if not trace.exists():
        pytest.skip(f"the Azure trace is not at {trace} (../shared/traces beside the checkout)")
    cases = heldout_cases(60.0, which)
    hand = [c for c in cases if "hand-made" in c.name]
    cal = [c for c in cases if "calibrated" in c.name]
    assert len(hand) == len(cal) == 2
    for c in hand:
        assert (c.slo_scale, c.tpot_scale) == (1.0, None)
    for c in cal:
        slo = c.slo()
        assert slo.tiers["standard"].tpot_ms == pytest.approx(60.0 * c.tpot_scale)
        assert slo.tiers["standard"].ttft_ms == pytest.approx(2000.0 * c.slo_scale)
    # Load scales with the fleet in both profiles.
    by_fleet = {c.replicas: c.workload["arrivals"]["sample_fraction"] for c in cal}
    assert by_fleet[4] == pytest.approx(2 * by_fleet[2])


def test_an_extra_policy_is_judged_beside_the_shipped_ones_and_a_bad_one_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = str(root / "benchmarks" / "policy_compare.py")
    bad = subprocess.run([sys.executable, script, "--policy", "x={", "--out", "", "--md", ""], capture_output=True,
                         text=True, cwd=root)
    assert bad.returncode != 0 and "--policy 'x={': not JSON" in bad.stderr and "Traceback" not in bad.stderr
    taken = subprocess.run([sys.executable, script, "--policy", 'slo (mpc)={"policy": "slo"}', "--out", "", "--md",
                            ""], capture_output=True, text=True, cwd=root)
    assert taken.returncode != 0 and "'slo (mpc)' is a shipped policy's name" in taken.stderr
    if not (TRACES / f"azure_llm_2023_{HELDOUT_SETS['E'][0]}.csv").exists():
        pytest.skip(f"the Azure trace is not in {TRACES} (../shared/traces beside the checkout)")
    out = tmp_path / "pc.json"
    capped = {"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "batch_cap": 2}
    subprocess.run([sys.executable, script, "--set", "E", "--seeds", "1", "--duration", "30", "--jobs", "1",
                    "--cases", "code@5min calibrated 2r", "--policy", "capped=" + json.dumps(capped),
                    "--out", str(out), "--md", str(tmp_path / "pc.md")], check=True, capture_output=True, cwd=root)
    result = json.loads(out.read_text())["results"][0]
    assert set(result["criterion"]) == {"slo (mpc)", "pid-live (old default)", "mpc, default guard", "capped"}
    assert "capped" in (tmp_path / "pc.md").read_text()
