"""``benchmarks/fidelity.py``'s simulator-leg options: ``--latency-from`` (the latency of calibrations taken
around the real leg, their coefficient-wise mean; the acceptance from ``--profile``), ``--sim-seeds`` (the
figures' mean over replications), ``--serving-overhead-ms`` (checked) and ``--open-loop`` (the recorded T)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import fidelity  # noqa: E402
from sim.profile import DEFAULT_PROFILE_PATH, Profile  # noqa: E402


def _with_latency(profile: Profile, path: Path, **update: float | None) -> str:
    profile.model_copy(update={"latency": profile.latency.model_copy(update=update)}).save(path)
    return str(path)


def test_latency_from_two_profiles_predicts_the_mean_of_their_steps(tmp_path: Path) -> None:
    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    lat = shipped.latency
    before = _with_latency(shipped, tmp_path / "before.json", draft_a_ms=lat.draft_a_ms * 1.2,
                           verify_a_ms=lat.verify_a_ms * 1.2, prefill_fixed_ms=300.0)
    after = _with_latency(shipped, tmp_path / "after.json", draft_a_ms=lat.draft_a_ms * 0.8,
                          verify_a_ms=lat.verify_a_ms * 0.9, prefill_fixed_ms=200.0)
    mean = fidelity.mean_latency(f"{before},{after}")
    one, two = Profile.load(before).latency, Profile.load(after).latency
    for batch in (1, 3, 8):
        for k in (0, 2, 4):
            expected = (float(one.iteration_ms(batch, k)) + float(two.iteration_ms(batch, k))) / 2
            assert float(mean.iteration_ms(batch, k)) == pytest.approx(expected)
    assert mean.prefill_ms(100) == pytest.approx((one.prefill_ms(100) + two.prefill_ms(100)) / 2)
    assert mean.prefill_fixed_ms == 250.0

    # setup(): the simulator leg's profile keeps --profile's acceptance and takes the mean latency.
    args = fidelity.build_parser().parse_args(["--latency-from", f"{before},{after}"])
    st = fidelity.setup(args, port=0)
    assert st.profile.latency == mean
    assert st.profile.acceptance == shipped.acceptance and st.profile.request_acceptance == shipped.request_acceptance


def test_latency_from_averages_measured_prefills_over_their_lengths(tmp_path: Path) -> None:
    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    before = _with_latency(shipped, tmp_path / "before.json", prefill_ms_by_tokens=[(16, 120.0), (64, 160.0)])
    after = _with_latency(shipped, tmp_path / "after.json", prefill_ms_by_tokens=[(16, 130.0), (128, 280.0)])
    mean = fidelity.mean_latency(f"{before},{after}")
    one, two = Profile.load(before).latency, Profile.load(after).latency
    assert [n for n, _ in mean.prefill_ms_by_tokens or []] == [16, 64, 128]
    for tokens in (8, 16, 40, 64, 100, 128, 600):  # below, between, at and beyond the measured lengths
        expected = (one.prefill_ms(tokens) + two.prefill_ms(tokens)) / 2
        assert mean.prefill_ms(tokens) == pytest.approx(expected), tokens


def test_latency_from_names_what_it_cannot_use(tmp_path: Path) -> None:
    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    derived = _with_latency(shipped, tmp_path / "derived.json", plain_step_a_ms=None, plain_step_b_ms=None)
    with pytest.raises(ValueError, match="plain_step_a_ms is measured in some profiles and not in others"):
        fidelity.mean_latency(f"{DEFAULT_PROFILE_PATH},{derived}")
    with pytest.raises(ValueError, match="--latency-from: .*missing.json"):
        fidelity.mean_latency(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no profile in ' , '"):
        fidelity.mean_latency(" , ")


def test_sim_replications_are_summarised_figure_by_figure() -> None:
    one = {"requests": 10, "tpot_ms": {"p50": 50.0, "p95": 80.0}, "ttft_ms": {"p50": None, "p95": 1.0}}
    two = {"requests": 10, "tpot_ms": {"p50": 54.0, "p95": 90.0}, "ttft_ms": {"p50": 2.0, "p95": 3.0}}
    assert fidelity.mean_summary([one, two]) == {"requests": 10.0, "tpot_ms": {"p50": 52.0, "p95": 85.0},
                                                 "ttft_ms": {"p50": None, "p95": 2.0}}


@pytest.mark.parametrize(("flag", "value"), [("--sim-seeds", "0"), ("--serving-overhead-ms", "-1"),
                                              ("--serving-overhead-ms", "nan")])
def test_simulator_leg_flags_name_a_bad_value(flag: str, value: str) -> None:
    args = fidelity.build_parser().parse_args([flag, value])
    with pytest.raises(ValueError, match=flag):
        fidelity.setup(args, port=0)


def _real_requests(n: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(2.0, size=n))
    return [{"arrival_s": float(a), "prompt_tokens": int(rng.integers(40, 120)), "output_tokens": int(rng.integers(24, 64)),
             "max_tokens": 64, "prompt_tokens_asked": 64} for a in arrivals]


def test_open_loop_runs_the_recorded_thresholds() -> None:
    """The simulator leg at the service's recorded T: a constant record is the static policy at that T to the
    request (same seed, no guards); a record that moves is followed tick by tick."""
    from policies.slo import SLOSpec
    from sim.profile import Profile

    slo, profile = SLOSpec.default(), Profile.load(DEFAULT_PROFILE_PATH)
    names = list(slo.tiers)
    args = fidelity.build_parser().parse_args(["--duration-s", "120", "--seed", "5"])
    real = _real_requests(60, seed=1)
    flat = [{"t_s": float(t), "thresholds": {n: (0.5 if n == "standard" else 0.0) for n in names}} for t in range(130)]
    static = fidelity.simulate(real, profile, slo, {"policy": "static", "thresholds": {"standard": 0.5},
                                                    "guards": False}, names, args)
    replayed = fidelity.simulate(real, profile, slo, {"policy": "pid"}, names, args, recorded=flat)
    assert replayed["records"] == static["records"]
    moving = [{"t_s": float(t), "thresholds": {n: (0.0 if t < 60 or n != "standard" else 1.0) for n in names}}
              for t in range(130)]
    run = fidelity.simulate(real, profile, slo, {"policy": "pid"}, names, args, recorded=moving)
    seen = {round(s["t_s"]): s["thresholds"]["standard"] for s in run["t_samples"]}
    assert {t: v for t, v in seen.items() if 1 <= t < 60} == dict.fromkeys(range(1, 60), 0.0)
    assert all(v == 1.0 for t, v in seen.items() if t >= 61)
    assert run["records"] != static["records"]


def test_open_loop_is_refused_where_it_cannot_replay_the_run() -> None:
    args = fidelity.build_parser().parse_args(["--open-loop", "--policy", '{"policy": "slo"}'])
    with pytest.raises(ValueError, match="--open-loop replays T only"):
        fidelity.setup(args, port=0)
    assert not fidelity.policy_moves_k('{"policy": "pid", "kp": 0.5}')
    assert fidelity.policy_moves_k('{"policy": "static", "thresholds": 1, "draft_lengths": 2}')
    with pytest.raises(ValueError, match="no T samples|T samples"):
        fidelity.RecordedThresholds([], ["standard"])
