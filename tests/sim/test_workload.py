import numpy as np
import pytest

from sim.workload import Workload

from .conftest import make_workload

TIERS = ["lossless", "standard", "economy"]


def _gen(w: Workload, seed: int = 0):
    return w.generate(np.random.default_rng(seed), TIERS, "standard")


def test_poisson_count_and_exponential_gaps() -> None:
    r = _gen(make_workload(duration_s=4000.0, arrivals={"kind": "poisson", "rate": 5.0}))
    n = len(r)
    # Count ~ Poisson(20000): within 4 standard deviations.
    assert abs(n - 20000) < 4 * np.sqrt(20000)
    gaps = np.diff(r.arrival_s)
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1.0, abs=0.05)
    assert np.all(gaps >= 0) and r.arrival_s.max() < 4000.0


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_gap_cv(burstiness: float) -> None:
    r = _gen(make_workload(duration_s=4000.0, arrivals={"kind": "poisson", "rate": 5.0}, burstiness=burstiness))
    gaps = np.diff(r.arrival_s)
    # Gamma(shape = burstiness): mean 1/rate, CV² = 1/burstiness.
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0 / burstiness, rel=0.1)


def test_step_rates_hold_per_segment() -> None:
    w = make_workload(
        duration_s=3000.0,
        arrivals={"kind": "step", "steps": [{"at_s": 0, "rate": 1.0}, {"at_s": 1000, "rate": 4.0},
                                            {"at_s": 2000, "rate": 0.0}]},
    )
    t = _gen(w).arrival_s
    assert abs((t < 1000).sum() - 1000) < 4 * np.sqrt(1000)
    assert abs(((t >= 1000) & (t < 2000)).sum() - 4000) < 4 * np.sqrt(4000)
    assert (t >= 2000).sum() == 0  # a zero-rate step gets no arrivals


def test_ramp_and_diurnal_follow_their_rate() -> None:
    ramp = make_workload(duration_s=2000.0, arrivals={"kind": "ramp", "start_rate": 0.0, "end_rate": 10.0})
    t = _gen(ramp).arrival_s
    first, second = (t < 1000).sum(), (t >= 1000).sum()
    assert second / first == pytest.approx(3.0, rel=0.1)  # ∫ of a linear ramp: 1/4 vs 3/4
    di = make_workload(duration_s=4000.0,
                       arrivals={"kind": "diurnal", "mean_rate": 5.0, "amplitude": 0.8, "period_s": 4000.0})
    t = _gen(di).arrival_s
    peak_half = ((t > 0) & (t < 2000)).sum()  # sin > 0 on the first half-period
    trough_half = (t >= 2000).sum()
    expected_ratio = (1 + 0.8 * 2 / np.pi) / (1 - 0.8 * 2 / np.pi)
    assert peak_half / trough_half == pytest.approx(expected_ratio, rel=0.1)


def test_lengths_and_tier_mix() -> None:
    w = make_workload(
        duration_s=2000.0,
        arrivals={"kind": "poisson", "rate": 5.0},
        prompt_tokens={"kind": "uniform", "low": 10, "high": 20},
        output_tokens={"kind": "lognormal", "median": 100, "sigma": 0.5, "max": 300},
        tier_mix={"standard": 3, "economy": 1},
    )
    r = _gen(w)
    assert r.prompt_tokens.min() >= 10 and r.prompt_tokens.max() <= 20
    assert np.median(r.output_tokens) == pytest.approx(100, rel=0.05)
    assert r.output_tokens.max() <= 300
    share_economy = (r.tier == TIERS.index("economy")).mean()
    assert share_economy == pytest.approx(0.25, abs=0.02)
    assert (r.tier == TIERS.index("lossless")).sum() == 0


def test_context_clipping_is_reported() -> None:
    w = make_workload(prompt_tokens={"kind": "fixed", "value": 3000}, output_tokens={"kind": "fixed", "value": 100},
                      max_context=1024)
    r = _gen(w)
    assert r.prompt_tokens.max() == 1023 and r.output_tokens.max() == 1
    assert any("clipped to max_context=1024" in n for n in r.notes)


def test_same_seed_same_requests_different_seed_different() -> None:
    w = make_workload()
    a, b, c = _gen(w, 1), _gen(w, 1), _gen(w, 2)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert not np.array_equal(a.arrival_s, c.arrival_s)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"arrivals": {"kind": "poisson", "rate": -1}}, "rate"),
        ({"arrivals": {"kind": "warp", "rate": 1}}, "arrivals"),
        ({"burstiness": 0}, "burstiness"),
        ({"output_tokens": {"kind": "uniform", "low": 5, "high": 2}}, "output_tokens"),
        ({"prompt_tokens": {"kind": "trace"}}, "prompt_tokens"),
        ({"duration_s": None}, "duration_s"),
        ({"arrivals": {"kind": "step", "steps": [{"at_s": 5, "rate": 1}]}}, "at_s"),
        ({"tier_mix": {"standard": -1}}, "tier_mix"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_workload_names_the_field(overrides, field) -> None:
    with pytest.raises(ValueError, match=field):
        make_workload(**overrides)


def test_tier_mix_naming_an_unknown_tier_fails_at_generation() -> None:
    w = make_workload(tier_mix={"gold": 1.0})
    with pytest.raises(ValueError, match="gold"):
        _gen(w)


def test_yaml_loading_and_errors(tmp_path) -> None:
    good = tmp_path / "w.yaml"
    good.write_text("name: y\nduration_s: 10\narrivals: {kind: poisson, rate: 2}\n")
    assert Workload.load(good).name == "y"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: y\nduration_s: 10\narrivals: {kind: poisson, rate: fast}\n")
    with pytest.raises(ValueError, match="rate"):
        Workload.load(bad)
    with pytest.raises(ValueError, match="does not exist"):
        Workload.load(tmp_path / "missing.yaml")


def test_shipped_example_workloads_load() -> None:
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "sim" / "workloads"
    for path in sorted(folder.glob("*.yaml")):
        w = Workload.load(path)
        assert w.name
