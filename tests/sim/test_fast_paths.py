"""The simulator's speed paths compute exactly what the plain formulations do (bit for bit): runs stay
reproducible across speed work, and a policy sees the same telemetry."""

from __future__ import annotations

import numpy as np
import pytest

from policies.decision import Decision
from policies.slo import SLOSpec
from policies.telemetry import Telemetry
from sim.entities import RequestTable, WindowBins
from sim.metrics import fast_summary, latencies_ms, tier_windows, window_summaries
from sim.profile import Profile
from sim.replica import DecodeSettings, _StepTable, survival_grid
from sim.simulator import SimConfig, SimResult, Simulator
from sim.workload import Requests
from tests.sim.conftest import handmade_profile, make_workload


def test_window_bins_match_add_at_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    bins = WindowBins(1.0, 60.0, 3)
    ref = np.zeros_like(bins.sums)
    for step in range(2000):
        n = int(rng.integers(1, 50))
        # Segments span one window or several (non-decreasing bins), as replicas add them.
        at = np.sort(rng.integers(0, 60, size=n)) if step % 3 else np.full(n, int(rng.integers(0, 60)))
        rows = rng.random((n, bins.n_features)) * float(rng.choice([1e-3, 1.0, 55.123, 1e3]))
        if rng.random() < 0.4:
            bins.subtract(at, rows)
            np.subtract.at(ref, at, rows)
        else:
            bins.add(at, rows)
            np.add.at(ref, at, rows)
        if rng.random() < 0.05:  # a tick reads a window mid-way
            w = int(rng.integers(0, 60))
            assert bins.window(w).tobytes() == ref[w].tobytes()
    got = np.array([bins.window(w) for w in range(ref.shape[0])])
    assert got.tobytes() == ref.tobytes()


def test_survival_grid_counts_match_direct_comparison() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows, k = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        accept = rng.random((rows, k))
        accept[rng.random((rows, k)) < 0.2] = 0.0  # padded positions past a tier's k
        accept[rng.random((rows, k)) < 0.1] = 1.0
        survival = np.cumprod(accept, axis=1)
        grid, tokens = survival_grid(survival)
        u = rng.random((40, rows))
        u[0, 0] = survival[0, 0]  # a draw exactly on a breakpoint
        g = grid.searchsorted(u, side="right")
        got = tokens[np.arange(rows), g]
        want = 1 + (u[:, :, None] < survival).sum(axis=2)
        np.testing.assert_array_equal(got, want)


def _numpy_summary(samples: np.ndarray) -> tuple[int, float, float, float, float]:
    """The interpolation fast_summary did in numpy before it moved to Python floats."""
    s = np.sort(samples)
    pos = np.array([50.0, 90.0, 95.0, 99.0]) / 100.0 * (s.size - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, s.size - 1)
    v = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return int(s.size), float(v[0]), float(v[1]), float(v[2]), float(v[3])


def test_fast_summary_matches_the_numpy_interpolation() -> None:
    rng = np.random.default_rng(11)
    for n in [*range(1, 40), 100, 257, 1000]:
        samples = rng.lognormal(4.0, 1.0, n)
        got = fast_summary(samples)
        assert (got.count, got.p50_ms, got.p90_ms, got.p95_ms, got.p99_ms) == _numpy_summary(samples)


class _Cycling:
    """Every tier's (T, k) redrawn at random on a third of the ticks: uniform-k batches, mixed-k ones,
    plain (k = 0) ones and truncations by decisions, all in one run."""

    def __init__(self, slo: SLOSpec, ks: tuple[int, ...], seed: int) -> None:
        self.slo, self.ks, self.seed = slo, ks, seed
        self.reset()

    def reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def decide(self, telemetry: Telemetry) -> Decision:
        if self.rng.random() < 0.66:
            return Decision()
        names = list(self.slo.tiers)
        # Often one k for every tier (uniform-k batches of several tiers), else one k per tier.
        ks = [int(self.rng.choice(self.ks))] * len(names) if self.rng.random() < 0.5 else [
            int(self.rng.choice(self.ks)) for _ in names]
        return Decision(thresholds={n: float(self.rng.choice([0.0, 0.3, 1.0, 4.0])) for n in names},
                        draft_lengths=dict(zip(names, ks, strict=True)))


def _plain_table_profile() -> Profile:
    base = handmade_profile()
    return Profile.model_validate({**base.model_dump(), "latency": {
        **base.latency.model_dump(), "plain_step_a_ms": 22.0, "plain_step_b_ms": 1.0,
        "plain_step_ms_by_batch": [10.0, 16.0, 19.0, 20.0]}})


def cycling_simulator(profile: Profile, seed: int, duration_s: float = 120.0) -> Simulator:
    """Three replicas, the three tiers at 6 req/s, every tier's (T, k) redrawn at random (:class:`_Cycling`)."""
    slo = SLOSpec.default()
    workload = make_workload(duration_s=duration_s, arrivals={"kind": "poisson", "rate": 6.0},
                             output_tokens={"kind": "lognormal", "median": 60, "sigma": 0.6, "max": 400},
                             tier_mix={"lossless": 0.2, "standard": 0.5, "economy": 0.3})
    return Simulator(SimConfig(seed=seed, replicas=3, max_batch=6), profile, slo, workload,
                     _Cycling(slo, tuple(profile.available_draft_lengths(profile.default_div)), seed))


def _run(profile: Profile, seed: int) -> tuple[SimResult, int]:
    sim = cycling_simulator(profile, seed)
    return sim.run(), sum(r.segments_drawn for r in sim.replicas)


@pytest.mark.parametrize("profile_name", ["handmade", "plain_table", "calibrated"])
def test_step_tables_hold_the_step_model_and_its_columns(profile_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every uniform-k segment reads its step ms and step columns from DecodeSettings.step_table: each table a
    run builds holds, at every row count, the latency model's step (the mixed model's formula at one k, or the
    profile's plain step per batch) and the columns the window sums need of it."""
    profile = {"handmade": handmade_profile, "plain_table": _plain_table_profile,
               "calibrated": Profile.default}[profile_name]()
    built: list[tuple[int, int, bool, _StepTable]] = []
    original = DecodeSettings.step_table

    def recording(self: DecodeSettings, tier: int, one_tier: bool, max_batch: int) -> _StepTable:
        table = original(self, tier, one_tier, max_batch)
        built.append((int(self.k_by_tier[tier]), tier, one_tier, table))  # the settings change later
        return table

    monkeypatch.setattr(DecodeSettings, "step_table", recording)
    _, segments = _run(profile, 1)
    assert segments > 100 and len(built) > 100
    lat = profile.latency
    n_t = len(SLOSpec.default().tiers)
    seen_ks = set()
    for k, tier, one_tier, table in built:
        seen_ks.add(k)
        rows = np.arange(table.ms.size, dtype=float)
        if k == 0 and lat.plain_step_ms_by_batch:
            plain = lat.plain_table(rows.size - 1)
            assert plain is not None and table.ms.tolist() == plain.tolist()
        elif k == 0:
            plain_fixed, plain_per_row = lat.plain_coeffs()
            np.testing.assert_allclose(table.ms, plain_fixed + plain_per_row * rows, rtol=1e-12)
        else:
            model = lat.speculative_step_ms(rows, rows * k, np.full(rows.size, float(k)), rows)
            np.testing.assert_allclose(table.ms, model, rtol=1e-12)
        f = table.features
        assert f[:, WindowBins.SEQ_ITERS].tolist() == rows.tolist() == (-f[:, WindowBins.ACCEPTED]).tolist()
        assert f[:, WindowBins.ITERS].tolist() == [1.0] * rows.size
        assert f[:, WindowBins.ITER_MS].tolist() == table.ms.tolist()
        assert f[:, WindowBins.DRAFTED].tolist() == (rows * k).tolist()
        assert f[:, WindowBins.SPEC_ITERS].tolist() == [float(k > 0)] * rows.size
        assert f[:, WindowBins.SPEC_ROWS].tolist() == (rows * (k > 0)).tolist()
        assert f[:, WindowBins.SPEC_DRAFTED_ROW_FORWARDS].tolist() == (rows * k).tolist()
        one_tier_column = f[:, WindowBins.BASE + 2 * n_t + tier]
        assert one_tier_column.tolist() == (rows if one_tier else np.zeros(rows.size)).tolist()
    assert 0 in seen_ks and len(seen_ks) > 1


def test_window_summaries_match_the_array_functions() -> None:
    """A control tick's completions summarised in Python floats per request: the same summaries, tier
    windows and met count as latencies_ms / fast_summary / tier_windows, bit for bit (reprs compared:
    NaN and the sign of zero included)."""
    rng = np.random.default_rng(17)
    slo = SLOSpec.default()
    names = tuple(slo.tiers)
    n = 400
    arrival = np.sort(rng.random(n) * 100.0)
    requests = Requests(arrival_s=arrival, prompt_tokens=rng.integers(1, 500, n),
                        output_tokens=rng.choice([1, 2, 3, 50, 200], n), tier=rng.integers(0, len(names), n).astype(np.int16),
                        tier_names=names)
    table = RequestTable(requests)
    table.first_token_s = arrival + rng.exponential(0.5, n) * rng.choice([1e-3, 1.0, 10.0], n)
    # Completions from at the first token (two tokens in one step: TPOT 0) to far past every target.
    table.completion_s = table.first_token_s + rng.exponential(5.0, n) * rng.choice([0.0, 1.0, 30.0], n)
    thresholds = {name: float(rng.random()) for name in names}
    draft_lengths = {name: int(rng.integers(0, 5)) for name in names}
    for trial in range(300):
        done = sorted(rng.choice(n, size=int(rng.integers(0, 40)), replace=False).tolist())
        if trial % 5 == 0:  # one tier alone (it holds every completion: the overall summaries serve)
            done = [rid for rid in done if table.tier_list[rid] == trial % len(names)]
        sums = rng.random((3, len(names))) * rng.choice([0.0, 1.0, 1e3])
        fast = window_summaries(table, done, slo, thresholds, sums[0], sums[1], sums[2], draft_lengths)
        assert fast is not None
        ids = np.array(done, dtype=np.int64)
        ttft, tpot, e2e = latencies = latencies_ms(table, ids)
        overall = (fast_summary(ttft), fast_summary(tpot[~np.isnan(tpot)]), fast_summary(e2e))
        tiers, met = tier_windows(table, ids, slo, thresholds, sums[0], sums[1], latencies, overall,
                                  tier_seq_iters=sums[2], draft_lengths=draft_lengths)
        assert repr(fast) == repr((overall, tiers, int(met.sum()))), f"trial {trial}"
    table.first_token_s[3] = np.nan  # a NaN latency: left to the array functions
    assert window_summaries(table, [3], slo, thresholds, sums[0], sums[1], sums[2], draft_lengths) is None
