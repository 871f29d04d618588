"""benchmarks/step_ratios.py on a ticks file: on a simulated history whose recorded operating model is the profile
the simulator ran (steps as the profile models them), every kind of step measures what the model says at every
batch, so the script forms the model's step as the policy does; a window's ratio is measured / modelled; an
unreadable file is refused by name."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from benchmarks.step_ratios import first_speculative_errors, fit_errors, main, window_ratios, window_steps
from policies.operating_model import DEFAULT_MODEL_PATH, OperatingModel
from policies.slo import SLOSpec
from tests.sim.conftest import recorded_history


def _simulated_ticks(tmp_path: Path) -> Path:
    """A ticks file of one simulated run of the shipped SLO policy, as ``benchmarks/load.py --ticks`` writes it."""
    path = tmp_path / "ticks.json.gz"
    history = recorded_history({"policy": "slo"}, SLOSpec.default())
    path.write_bytes(gzip.compress(json.dumps({"runs": [{"name": "slo", "round": 0, "history": history}]}).encode()))
    return path


def test_a_simulated_history_measures_its_own_model(tmp_path: Path) -> None:
    path = _simulated_ticks(tmp_path)
    out = tmp_path / "out.json"
    assert main([str(path), "--out", str(out)]) == 0
    kinds = json.loads(out.read_text())["files"][str(path)]
    assert len([k for k in kinds if k.startswith("k")]) >= 2, kinds  # several k_max, several batches each
    assert sum(len(by_batch) for by_batch in kinds.values()) >= 4, kinds
    for kind, by_batch in kinds.items():
        for batch, cell in by_batch.items():
            assert cell["windows"] > 0 and cell["min"] == cell["max"] == pytest.approx(1.0, abs=1e-3), (kind, batch)


def test_a_window_ratio_is_measured_over_modelled() -> None:
    model = OperatingModel.load(DEFAULT_MODEL_PATH)
    fixed, per_row = model.cost.plain_line(2.0)
    modelled = float(fixed + per_row * 2.0)
    ((kind, batch, ratio),) = window_ratios({"plain_steps": {"steps": 10, "rows": 20, "ms": 10 * 1.3 * modelled}},
                                            model)
    assert (kind, batch) == ("plain", 2.0) and ratio == pytest.approx(1.3)
    assert window_ratios({"plain_steps": {"steps": 0, "rows": 0, "ms": 0.0}}, model) == []


def test_an_unreadable_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="step_ratios: history file"):
        main([str(path)])


def test_fits_on_a_simulated_history_predict_its_own_model(tmp_path: Path) -> None:
    """--fits: on steps exactly as the model says, both fit shapes predict every window at ratio 1."""
    path = _simulated_ticks(tmp_path)
    out = tmp_path / "out.json"
    assert main([str(path), "--fits", "--out", str(out)]) == 0
    errors = json.loads(out.read_text())["fit_errors"]
    assert set(errors) == {"line", "batch"}
    for groups in errors.values():
        assert sum(g["windows"] for g in groups.values()) > 10, groups
        assert all(g["max_abs"] < 1e-3 for g in groups.values()), groups


def test_after_a_rise_the_fit_by_batch_predicts_a_hump_the_line_extrapolates() -> None:
    """Plain steps 1.1x the model at one row and 1.3x at two (alternating), then a burst at five rows at 1.1x
    (the live shape, sessions 31-32): the line over-predicts the first windows at five rows, the fit by batch
    reads them at the pooled level."""
    model = OperatingModel.load(DEFAULT_MODEL_PATH)

    def window(batch: int, ratio: float) -> dict[str, object]:
        fixed, per_row = model.cost.plain_line(float(batch))
        return {"plain_steps": {"steps": 10, "rows": 10 * batch, "ms": 10 * ratio * float(fixed + per_row * batch)}}

    run = [window(1 + i % 2, 1.1 if i % 2 == 0 else 1.3) for i in range(20)] + [window(5, 1.1) for _ in range(3)]
    errors = fit_errors([run], [model], step_slope_prior=1.5)  # the plain fit's prior before session 37
    line_rise, batch_rise = errors["line"]["plain after a rise"], errors["batch"]["plain after a rise"]
    assert len(line_rise) == len(batch_rise) == 1
    assert line_rise[0] > 0.2 and 0.0 < batch_rise[0] < 0.15
    # The shipped plain fit (prior 0.05 since session 37) reads one ratio: no hump extrapolated either.
    (shipped_rise,) = fit_errors([run], [model])["line"]["plain after a rise"]
    assert 0.0 < shipped_rise < 0.15


def test_first_speculative_scores_each_prior_on_a_run_s_first_speculative_window() -> None:
    """Plain steps at 1.2x the model for four windows, then speculative ones at 1.2x: the model's prior misses the
    first by log(1 / 1.2), the plain steps' fit predicts it; later speculative windows are not scored; a run that
    drafts before three plain windows is not a prior's test."""
    model = OperatingModel.load(DEFAULT_MODEL_PATH)
    fixed, per_row = model.cost.plain_line(2.0)
    plain = {"plain_steps": {"steps": 10, "rows": 20, "ms": 10 * 1.2 * float(fixed + per_row * 2.0)}}
    spec_totals = {"steps": 2, "rows": 4, "draft_forwards": 8, "verify_tokens": 16, "drafted_row_forwards": 16}
    ((_, batch, _, spec_fixed, spec_per_row),) = window_steps({"speculative_steps": {**spec_totals, "ms": 1.0}}, model)
    spec = {"speculative_steps": {**spec_totals, "ms": 2 * 1.2 * (spec_fixed + spec_per_row * batch)}}
    errors = first_speculative_errors([[plain] * 4 + [spec, spec], [plain, spec]], [model, model])
    assert errors["model"] == [pytest.approx(math.log(1 / 1.2))]
    assert errors["plain"] == [pytest.approx(0.0, abs=1e-9)]


def _noisy_windows(latency: dict[str, object], seed: int, duration_s: float = 3600.0,
                   k: int = 0) -> tuple[list[dict], object]:
    """An hour of decoding at draft length ``k`` (0: plain) on one replica of the calibrated profile whose steps
    depart from it as ``latency`` says: each window's telemetry as a controller records it, and the model it is
    measured against."""
    from policies.static import StaticPolicy
    from sim.decision_replay import profile_model
    from sim.profile import Profile
    from tests.sim.conftest import Recorder, make_workload, run_sim, single_tier_slo

    base = Profile.default()
    data = base.model_dump()
    data["latency"].update(latency)
    slo = single_tier_slo(tpot_ms=200.0)
    recorder = Recorder(StaticPolicy(slo, 0.0, k))
    workload = make_workload(duration_s=duration_s, arrivals={"kind": "poisson", "rate": 0.5},
                             prompt_tokens={"kind": "fixed", "value": 40}, output_tokens={"kind": "fixed", "value": 48})
    run_sim(workload, recorder, slo=slo, profile=Profile.model_validate(data), replicas=1, seed=seed)
    return [entry["telemetry"] for entry in recorder.entries], profile_model(base)


def test_noise_recovers_the_simulated_machine() -> None:
    """--noise measures what the simulator's step drift draws (a statistical check, fixed seeds): the shape by
    batch within 5 % (arithmetic means, as the simulator's factors are), the drift's and the jitter's spreads
    within 30 %, the drift's correlation time within 2x; and on steps exactly as modelled it finds no shape, no
    drift and next to no jitter."""
    from benchmarks.step_ratios import step_noise

    truth = {"plain_step_scale_by_batch": [1.1, 1.3, 1.25, 1.15], "step_drift_sigma": 0.12, "step_drift_tau_s": 15.0,
             "step_jitter_sigma": 0.25}
    for seed in (1, 2):
        windows, model = _noisy_windows(truth, seed)
        noise = step_noise([windows], [model], "plain")
        assert noise["windows"] > 1000, noise
        for batch, cell in noise["scale_by_batch"].items():
            if cell["windows"] >= 100:
                want = truth["plain_step_scale_by_batch"][min(int(batch), 4) - 1]
                assert cell["scale"] == pytest.approx(want, rel=0.05), (seed, batch, noise)
        assert noise["drift_sigma"] == pytest.approx(0.12, rel=0.3), noise
        assert noise["jitter_sigma"] == pytest.approx(0.25, rel=0.3), noise
        assert 7.5 <= noise["drift_tau_s"] <= 30.0, noise
    exact, model = _noisy_windows({}, 1, duration_s=900.0)
    quiet = step_noise([exact], [model], "plain")
    # The recording's own floor (a window's steps cut at its edges) reads as a little jitter, a fifth of the truth's.
    assert quiet["drift_sigma"] < 0.03 and quiet["jitter_sigma"] < 0.08, quiet
    assert all(cell["scale"] == pytest.approx(1.0, abs=0.03) for cell in quiet["scale_by_batch"].values()), quiet


def test_long_speculative_steps_are_read_at_every_batch_and_not_fast() -> None:
    """Speculative steps of k = 6 take a third of a window or more, so most windows hold fewer than four of them (the
    fit's filter): the shape by batch is read from every window's sums (fixed seed), so each batch from one to six
    rows is there and within 5 % of the machine's (1.0 rising to 1.25)."""
    from benchmarks.step_ratios import noise_windows, step_noise

    truth = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25]
    machine = {"speculative_step_scale_by_batch": truth, "step_jitter_sigma": 0.05,
               "speculative_step_jitter_sigma": 0.08}
    windows, model = _noisy_windows(machine, 5, duration_s=1800.0, k=6)
    read = step_noise([windows], [model], "speculative")
    scales = read["scale_by_batch"]
    for rows, want in enumerate(truth, start=1):
        assert scales[str(rows)]["scale"] == pytest.approx(want, rel=0.05), (rows, read)
    assert sum(cell["steps"] for cell in scales.values()) > 3000, read
    four_or_more, _ = noise_windows([windows], [model], "speculative", 4, 0.1)
    assert len(four_or_more) < sum(cell["windows"] for cell in scales.values()) / 2, read


def test_each_kind_of_step_has_its_own_jitter() -> None:
    """A machine whose plain steps jitter 0.3 and speculative ones 0.08 (live, ~0.22 and ~0.07): --noise reads
    each kind's own spread from its windows (within 30 %, fixed seed), so the simulator is handed both."""
    from benchmarks.step_ratios import step_noise

    machine = {"step_jitter_sigma": 0.3, "speculative_step_jitter_sigma": 0.08}
    plain, model = _noisy_windows(machine, 3, duration_s=1200.0)
    speculative, _ = _noisy_windows(machine, 3, duration_s=1200.0, k=4)
    assert step_noise([plain], [model], "plain")["jitter_sigma"] == pytest.approx(0.3, rel=0.3)
    read = step_noise([speculative], [model], "speculative")
    assert read["windows"] > 200 and read["jitter_sigma"] == pytest.approx(0.08, rel=0.3), read


def test_prefill_noise_reads_a_machine_s_slower_prefills() -> None:
    """Joins' prefills 1.3x the profile's on the simulated machine (live: ~1.25x): the median single-join window
    reads 1.3 (within 5 %, fixed seed); on the profile as is, 1. A prefill of two arrivals' window is not read."""
    from benchmarks.load_sim import with_step_noise
    from benchmarks.step_ratios import prefill_noise
    from sim.profile import Profile

    latency = Profile.default().latency
    slow = with_step_noise(Profile.default(), {"plain": {"drift_sigma": 0.0, "jitter_sigma": 0.0},
                                               "prefill": {"scale": 1.3}}).latency
    assert slow.target_prefill_ms(40) == pytest.approx(1.3 * latency.target_prefill_ms(40))
    prefills = {key: getattr(slow, key) for key in ("prefill_fixed_ms", "prefill_ms_per_token", "prefill_ms_by_tokens")}
    windows, _ = _noisy_windows(prefills, 4, duration_s=1200.0)
    read = prefill_noise([windows], [40.0], latency)
    assert read["windows"] > 100 and read["scale"] == pytest.approx(1.3, rel=0.05), read
    as_is, _ = _noisy_windows({}, 4, duration_s=1200.0)
    assert prefill_noise([as_is], [40.0], latency)["scale"] == pytest.approx(1.0, rel=0.05)
    assert prefill_noise([[{"arrivals": 2, "prefill_ms": 500.0}] * 20], [40.0], latency) == {"windows": 0}


def test_noise_reads_the_prompt_length_from_the_report_the_ticks_file_names(tmp_path: Path) -> None:
    """--noise measures prefills at the mean prompt of the requests in the report a ticks file names; without one
    (or where it is gone) at ``--prompt-tokens``."""
    from benchmarks.step_ratios import report_prompt_tokens

    report = tmp_path / "report.json"
    records = [{"prompt_tokens": 36}, {"prompt_tokens": 40}, {"status": 503}]
    report.write_text(json.dumps({"runs": [{"records": records}]}))
    named = tmp_path / "named_ticks.json.gz"
    named.write_bytes(gzip.compress(json.dumps({"report": str(report), "runs": []}).encode()))
    bare = tmp_path / "bare_ticks.json"
    bare.write_text(json.dumps({"runs": []}))
    assert report_prompt_tokens(str(named), 40.0) == pytest.approx(38.0)
    assert report_prompt_tokens(str(bare), 40.0) == 40.0
    report.unlink()
    assert report_prompt_tokens(str(named), 41.0) == 41.0

    path = _simulated_ticks(tmp_path)
    out = tmp_path / "out.json"
    assert main([str(path), "--noise", "--out", str(out)]) == 0
    noise = json.loads(out.read_text())["noise"]
    assert set(noise) == {"plain", "speculative", "prefill"} and "windows" in noise["prefill"], noise


def test_offsets_against_a_machine_read_how_far_the_runs_sit_from_it(tmp_path: Path) -> None:
    """--against: windows of a machine whose plain steps run 1.1-1.3x the profile by batch sit at offset 0 from that
    machine, at -log 1.2 from one 1.2x slower at every batch, in z its run spread; a file is read by name."""
    from benchmarks.step_ratios import machine_offsets

    shape = [1.1, 1.3, 1.25, 1.15]
    windows, model = _noisy_windows({"plain_step_scale_by_batch": shape}, 5, duration_s=900.0)

    def machine(factor: float) -> dict[str, object]:
        return {"plain": {"scale_by_batch": {str(b + 1): {"scale": factor * s} for b, s in enumerate(shape)},
                          "run_offset": {"mean": 0.0, "sd": 0.05}}}

    same = machine_offsets([windows], [model], machine(1.0))
    assert same["plain"]["windows"] > 200 and same["plain"]["offset"] == pytest.approx(0.0, abs=0.005), same
    slower = machine_offsets([windows], [model], machine(1.2))["plain"]
    assert slower["offset"] == pytest.approx(-math.log(1.2), abs=0.005)
    assert slower["z"] == pytest.approx(slower["offset"] / 0.05, abs=0.01)
    assert same["speculative"] == {"windows": 0}  # no speculative steps, no scale for them

    path = _simulated_ticks(tmp_path)
    noise, out = tmp_path / "noise.json", tmp_path / "out.json"
    noise.write_text(json.dumps({"noise": machine(1.0)}))
    assert main([str(path), "--against", str(noise), "--out", str(out)]) == 0
    against = json.loads(out.read_text())["against"]
    assert against["noise"] == str(noise) and set(against["files"][str(path)]) == {"plain", "speculative"}
    with pytest.raises(SystemExit, match="--against"):
        main([str(path), "--against", str(tmp_path / "missing.json")])


def test_per_run_offsets_tell_a_slow_run_from_its_neighbours(tmp_path: Path) -> None:
    """--per-run: two runs of the same windows, the second's steps 1.3x as long (its host slower), sit log 1.3 apart
    in each kind's offset; each run carries its attainment from the report the ticks file names, scored as
    benchmarks/load.py scores a round (every target the tier states); --per-run without --against is refused."""
    history = recorded_history({"policy": "slo"}, SLOSpec.default())
    slow = json.loads(json.dumps(history))
    for entry in slow:
        for kind in ("plain_steps", "speculative_steps"):
            steps = (entry.get("telemetry") or {}).get(kind)
            if steps:
                steps["ms"] *= 1.3
    report = tmp_path / "report.json"
    ok = {"status": 200, "e2e_ms": 5000.0, "ttft_ms": 300.0}
    records = {"fast": [{**ok, "tpot_ms": 80.0}] * 3 + [{**ok, "tpot_ms": 120.0}],
               "slow": [{**ok, "tpot_ms": 80.0}, {**ok, "tpot_ms": 80.0, "ttft_ms": 5000.0}, {"status": 503}]}
    report.write_text(json.dumps({
        "configs": [{"name": "slo", "tpot_target_ms": 97.0, "ttft_target_ms": 4000.0}],
        "runs": [{"name": "slo", "round": r, "records": records[name], "t_samples": []}
                 for r, name in enumerate(("fast", "slow"))]}))
    path = tmp_path / "ticks.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"report": str(report), "runs": [
        {"name": "slo", "round": 0, "history": history}, {"name": "slo", "round": 1, "history": slow}]}).encode()))
    machine = {"plain": {"scale_by_batch": {str(b): {"scale": 1.0} for b in range(1, 9)}},
               "speculative": {"scale_by_batch": {str(b): {"scale": 1.0} for b in range(1, 9)}}}
    noise, out = tmp_path / "noise.json", tmp_path / "out.json"
    noise.write_text(json.dumps({"noise": machine}))
    assert main([str(path), "--against", str(noise), "--per-run", "--out", str(out)]) == 0
    runs = {r["run"]: r for r in json.loads(out.read_text())["against"]["files"][str(path)]["runs"]}
    assert set(runs) == {"slo:0", "slo:1"}
    assert runs["slo:0"]["slo_attainment"] == 0.75 and runs["slo:1"]["slo_attainment"] == pytest.approx(1 / 3, abs=1e-4)
    measured = [kind for kind in ("plain", "speculative") if runs["slo:0"][kind]["windows"] > 0]
    assert "speculative" in measured, runs  # the shipped policy drafts here (plain windows may all be filtered)
    for kind in measured:
        gap = runs["slo:1"][kind]["offset"] - runs["slo:0"][kind]["offset"]
        assert gap == pytest.approx(math.log(1.3), abs=2e-3), (kind, runs)
    with pytest.raises(SystemExit, match="--per-run needs --against"):
        main([str(path), "--per-run"])
