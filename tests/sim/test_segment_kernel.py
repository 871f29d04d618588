"""sim.segment_kernel draws what Replica's numpy path draws: the same requests' times bit for bit, the same
window sums (integer columns exactly; the distortion sums to rounding, whose order the numpy product leaves
to BLAS), over runs that cycle every tier's (T, k) through uniform-k, mixed-k and plain batches."""

from __future__ import annotations

import numpy as np
import pytest

import sim.replica as replica_module
from sim.entities import WindowBins
from sim.profile import SEPARATE_KV_PROFILE_PATH, Profile
from sim.simulator import SimResult, Simulator
from tests.sim.conftest import handmade_profile
from tests.sim.test_fast_paths import _plain_table_profile, cycling_simulator

# Columns that hold sums of distortion (float products, summed in an order numpy's matmul does not fix).
_DISTORTION_COLUMNS = {WindowBins.DISTORTION}


def _run(profile: Profile, seed: int, kernel: bool,
         monkeypatch: pytest.MonkeyPatch) -> tuple[Simulator, SimResult, int]:
    """A short three-tier run under a policy that redraws (T, k): the simulator, its result, the kernel's calls."""
    monkeypatch.setattr(replica_module, "_KERNEL_ENABLED", kernel)
    calls = [0]
    compiled = replica_module.draw_segment

    def counting(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return compiled(*args)

    monkeypatch.setattr(replica_module, "draw_segment", counting)
    sim = cycling_simulator(profile, seed, duration_s=150.0)
    return sim, sim.run(), calls[0]


def _varying_profile() -> Profile:
    """The plain-table profile on a machine that departs from it: a shape by batch, drift and jitter."""
    data = _plain_table_profile().model_dump()
    data["latency"].update(plain_step_scale_by_batch=[1.1, 1.3, 1.2], speculative_step_scale_by_batch=[0.9, 1.05],
                           step_offset_sigma=0.1, step_drift_sigma=0.15, step_drift_tau_s=5.0, step_jitter_sigma=0.2,
                           speculative_step_jitter_sigma=0.05)
    return Profile.model_validate(data)


@pytest.mark.parametrize(("profile_name", "seed"),
                         [("handmade", 1), ("handmade", 2), ("plain_table", 3), ("calibrated", 4), ("varying", 5)])
def test_kernel_draws_what_the_numpy_path_draws(profile_name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibrated profile draws each request's acceptance odds (per-row survival); the hand-made ones
    have distortion events."""
    profile = {"handmade": handmade_profile, "plain_table": _plain_table_profile,
               "calibrated": Profile.default, "varying": _varying_profile}[profile_name]()
    reference, ref_result, none = _run(profile, seed, False, monkeypatch)
    compiled, result, calls = _run(profile, seed, True, monkeypatch)
    segments = sum(r.segments_drawn for r in compiled.replicas)
    assert none == 0 and segments > 300
    assert calls == segments  # this profile has no case the kernel leaves to numpy
    a, b = ref_result.records, result.records
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)  # NaN == NaN here
    assert ref_result.summary["completed"] == result.summary["completed"] > 500
    sums_a, sums_b = reference.bins.sums, compiled.bins.sums
    n_t = reference.bins.n_tiers
    exact = [c for c in range(sums_a.shape[1]) if c not in _DISTORTION_COLUMNS
             and not WindowBins.BASE + n_t <= c < WindowBins.BASE + 2 * n_t]
    np.testing.assert_array_equal(sums_a[:, exact], sums_b[:, exact])
    np.testing.assert_allclose(sums_a, sums_b, rtol=1e-12, atol=1e-12)
    # Each kind of batch went through the kernel: plain steps, drafting ones, several tiers at several ks.
    spec_iters, iters = sums_b[:, WindowBins.SPEC_ITERS].sum(), sums_b[:, WindowBins.ITERS].sum()
    assert 0 < spec_iters < iters


def test_kernel_leaves_the_draft_backlog_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile that measures the draft's prefill apart keeps a backlog per request: the numpy path draws it."""
    profile = Profile.load(SEPARATE_KV_PROFILE_PATH)
    assert profile.latency.models_draft_prefill
    sim, _, calls = _run(profile, 5, True, monkeypatch)
    assert calls == 0 and sum(r.segments_drawn for r in sim.replicas) > 100
