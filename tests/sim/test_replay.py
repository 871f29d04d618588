"""Replaying a recorded trace: exact arrivals/tokens/tiers, filled-in rejections, per-tier verdicts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policies.slo import SLOSpec
from policies.static import StaticPolicy
from sim.replay import replay, requests_from_trace, tier_verdicts
from sim.simulator import SimConfig
from sim.trace import read_azure_trace, write_azure_trace

from .conftest import handmade_profile


def _recorded(tmp_path: Path, n: int = 40, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(0.5, n))
    prompt = rng.integers(5, 200, n)
    output = rng.integers(1, 120, n)
    tiers = [["standard", "economy", None][i % 3] for i in range(n)]
    status = ["stop"] * n
    status[3] = "rejected"
    prompt[3] = output[3] = 0
    status[5] = "cut"
    path = tmp_path / "rec.csv"
    write_azure_trace(path, 1_700_000_000 + arrival, prompt, output, tier=tiers,
                      max_tokens=np.full(n, 128), status=status)
    return path


def test_requests_replay_the_recording_exactly(tmp_path: Path) -> None:
    trace = read_azure_trace(_recorded(tmp_path))
    slo = SLOSpec.default()
    r = requests_from_trace(trace, slo)
    assert np.array_equal(r.arrival_s, trace.arrival_s)
    measured = np.array([s != "rejected" for s in trace.status])
    assert np.array_equal(r.prompt_tokens[measured], trace.prompt_tokens[measured])
    assert np.array_equal(r.output_tokens[measured], trace.output_tokens[measured])
    names = [r.tier_names[i] for i in r.tier]
    assert names == [t or slo.default_tier for t in trace.tier]
    # The rejected row (index 3, tier standard) gets the median lengths of standard's finished rows.
    finished_std = [i for i, (t, s) in enumerate(zip(names, trace.status, strict=True))
                    if t == "standard" and s == "stop"]
    assert r.prompt_tokens[3] == int(np.median(trace.prompt_tokens[finished_std]))
    assert r.output_tokens[3] == int(np.median(trace.output_tokens[finished_std]))
    assert any("1 requests rejected live" in n for n in r.notes)


def test_unknown_tier_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    write_azure_trace(path, np.array([0.0]), np.array([3]), np.array([4]), tier=["gold"])
    with pytest.raises(ValueError, match="Tier 'gold'"):
        requests_from_trace(read_azure_trace(path), SLOSpec.default())


def test_replay_runs_every_policy_on_the_same_requests_with_the_baseline_first(tmp_path: Path) -> None:
    slo = SLOSpec.default()
    requests = requests_from_trace(read_azure_trace(_recorded(tmp_path)), slo)
    policies = {"fast": StaticPolicy(slo, 1.0), "lossless": StaticPolicy(slo, 0.0)}
    out = replay(requests, slo, handmade_profile(), SimConfig(replicas=1), policies, baseline="lossless")
    assert [r.name for r in out.runs] == ["lossless", "fast"] and out.baseline.name == "lossless"
    for run in out.runs:
        rec = run.result.records
        assert np.array_equal(rec["arrival_s"], requests.arrival_s)
        assert np.array_equal(rec["output_tokens"], requests.output_tokens)
        assert set(run.verdicts) == {"standard", "economy"}
    lossless = out.runs[0].verdicts["economy"]
    assert lossless.mean_distortion == 0.0 and lossless.distortion_ok  # T = 0 is exact
    assert out.runs[1].verdicts["economy"].mean_distortion > 0.0


def test_verdict_applies_percentile_and_budget_per_tier() -> None:
    slo = SLOSpec.default()
    summary = {"tiers": {"standard": {"arrivals": 10, "slo_attainment": 0.96, "mean_distortion": 0.2},
                         "economy": {"arrivals": 5, "slo_attainment": 0.9, "mean_distortion": 0.1}}}
    v = tier_verdicts(summary, slo)
    assert v["standard"].attainment_ok and not v["standard"].distortion_ok and not v["standard"].meets
    assert not v["economy"].attainment_ok and v["economy"].distortion_ok
    summary["tiers"]["standard"]["mean_distortion"] = 0.15
    assert tier_verdicts(summary, slo)["standard"].meets
