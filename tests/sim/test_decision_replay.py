"""A control history replayed through a policy (sim.decision_replay): the windows a policy decided on, as JSON,
decide the same again; a history file reads back; bad input is refused by name."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from policies.registry import resolve_spec
from policies.slo import SLOSpec
from policies.telemetry import Telemetry, telemetry_from_json, to_json
from sim.decision_replay import build_policy, last_policy_span, load_histories, profile_model, replay, summary
from tests.sim.conftest import handmade_profile, recorded_history


def test_simulated_windows_round_trip_and_replay_to_the_same_decisions() -> None:
    """Three tiers, step totals by kind, NaN percentiles of empty windows: each window reads back to the JSON it
    came from, and a fresh object of the spec that ran decides what it decided at every tick."""
    slo = SLOSpec.default()
    spec = {"policy": "slo"}
    history = recorded_history(spec, slo)
    span = last_policy_span(history)
    assert span.spec == resolve_spec(spec) and span.slo == slo and len(span.ticks) >= 100
    for entry in span.ticks:
        assert json.loads(json.dumps(to_json(telemetry_from_json(entry["telemetry"])))) == entry["telemetry"]
    ticks = replay(span, build_policy(span.spec, slo, profile_model(handmade_profile())), slo)
    out = summary(ticks)
    assert out["differ"] == 0 and out["same"] == len(span.ticks), out["first_differences"]
    assert len({json.dumps(t.recorded) for t in ticks}) > 3  # it moved (T and k), so equality means something
    # Another model (the default pair's, not the profile the run used) decides otherwise on the same windows.
    assert summary(replay(span, build_policy(spec, slo, None), slo))["differ"] > 0


def test_a_history_replays_exactly_after_a_default_changed() -> None:
    """A history records the spec written out: recorded when a default was other than today's (``budget_margin``
    0.3, say, so that the spec as given, ``{"policy": "slo"}``, then meant that), it replays equal through the
    written-out spec; read as given, under today's defaults, it does not (the check can fail)."""
    slo = SLOSpec.default()
    ran = {"policy": "slo", "budget_margin": 0.3}  # what "slo" built under that older default
    history = recorded_history(ran, slo)
    event = history[1]["event"]
    event["policy"] = event["previous_policy"] = {"policy": "slo"}  # as the controller recorded the PUT then
    model = profile_model(handmade_profile())
    span = last_policy_span(history)
    assert span.spec == resolve_spec(ran)
    out = summary(replay(span, build_policy(span.spec, slo, model), slo))
    assert out["differ"] == 0 and out["same"] == len(span.ticks), out["first_differences"]
    del event["resolved_policy"]  # a history from before resolved specs were recorded (and before relax_delay_s)
    as_given = last_policy_span(history)
    assert as_given.spec == {**resolve_spec({"policy": "slo"}), "relax_delay_s": 0.0, "initial_margin": 1.3,
                             "best_effort_relax_s": 0.0}
    assert summary(replay(as_given, build_policy(as_given.spec, slo, model), slo))["differ"] > 0


def test_a_resolved_spec_from_before_a_parameter_existed_replays_without_it() -> None:
    """A spec written out before ``relax_delay_s`` existed (session 34, default 4 s) lacks it: the policy that ran
    had no delay, and the replay rebuilds that one (0 s), equal at every tick. Filled with today's default, the same
    history (an economy step load 0.3 → 1.5 → 0.3 req/s, where the delay holds T) replays otherwise."""
    slo = SLOSpec.default()
    ran = {"policy": "slo", "relax_delay_s": 0.0}
    steps = [{"at_s": 0, "rate": 0.3}, {"at_s": 40, "rate": 1.5}, {"at_s": 80, "rate": 0.3}]
    history = recorded_history(ran, slo, arrivals={"kind": "step", "steps": steps}, tier_mix={"economy": 1.0})
    del history[1]["event"]["resolved_policy"]["relax_delay_s"]
    model = profile_model(handmade_profile())
    span = last_policy_span(history)
    assert span.spec["relax_delay_s"] == 0.0 and span.spec == resolve_spec(ran)
    assert summary(replay(span, build_policy(span.spec, slo, model), slo))["differ"] == 0
    today = {k: v for k, v in span.spec.items() if k != "relax_delay_s"}
    assert summary(replay(span, build_policy(today, slo, model), slo))["differ"] > 0


def test_a_spec_recorded_as_given_replays_with_the_margin_it_ran() -> None:
    """Every history whose spec was recorded as given (not written out: before session 40) ran the initial margin
    of 1.3, the default until session 43 (1.7 since), and no best-effort relax delay (20 s since session 45): the
    replay rebuilds them, equal at every tick; today's default margin
    replays the same step load otherwise."""
    slo = SLOSpec.default()
    ran = {"policy": "slo", "relax_delay_s": 0.0, "initial_margin": 1.3, "best_effort_relax_s": 0.0}
    steps = [{"at_s": 0, "rate": 0.3}, {"at_s": 40, "rate": 1.5}, {"at_s": 80, "rate": 0.3}]
    history = recorded_history(ran, slo, arrivals={"kind": "step", "steps": steps}, tier_mix={"economy": 1.0})
    event = history[1]["event"]
    event["policy"] = event["previous_policy"] = {"policy": "slo"}
    del event["resolved_policy"]
    model = profile_model(handmade_profile())
    span = last_policy_span(history)
    assert span.spec == resolve_spec(ran) and span.spec["initial_margin"] == 1.3
    assert summary(replay(span, build_policy(span.spec, slo, model), slo))["differ"] == 0
    today = {**span.spec, "initial_margin": resolve_spec({"policy": "slo"})["initial_margin"]}
    assert today["initial_margin"] == 1.7
    assert summary(replay(span, build_policy(today, slo, model), slo))["differ"] > 0


def test_history_files_read_back_by_label(tmp_path: Path) -> None:
    history = [{"time_s": 1.0, "telemetry": to_json(Telemetry(time_s=1.0, window_s=1.0)), "decision": None}]
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"history": history}))
    assert load_histories(status) == {"status": history}
    ticks = tmp_path / "ticks.json.gz"
    ticks.write_bytes(gzip.compress(json.dumps({"runs": [{"name": "slo", "round": 1, "history": history}]}).encode()))
    assert load_histories(ticks) == {"slo:1": history}
    span = last_policy_span(history)
    assert span.event is None and span.spec is None and len(span.ticks) == 1


@pytest.mark.parametrize(("content", "message"), [
    ("[1, 2]", "expected a /v1/fsd/status answer"),
    ("{not json", "history file"),
])
def test_a_bad_history_file_is_refused_by_name(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "h.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_histories(path)


def test_a_window_with_an_unknown_or_missing_field_is_refused_by_name() -> None:
    good = to_json(Telemetry(time_s=1.0, window_s=1.0))
    assert isinstance(good, dict)
    with pytest.raises(ValueError, match=r"telemetry: unknown field\(s\) \['bogus'\]"):
        telemetry_from_json({**good, "bogus": 1})
    with pytest.raises(ValueError, match="telemetry.tiers.economy: unknown field"):
        telemetry_from_json({**good, "tiers": {"economy": {"threshold": 1.0, "p95": 3}}})
    with pytest.raises(ValueError, match="telemetry: .*window_s"):
        telemetry_from_json({k: v for k, v in good.items() if k != "window_s"})


def test_fsd_sim_decisions_replays_a_ticks_file_and_names_a_missing_run(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI on a benchmarks/load.py --ticks file: the spec that ran replays equal on the operating model the
    history recorded (the default) and on the same profile given; another spec (--policy) or another model
    (--profile) does not; an unknown --run is an error naming the runs there."""
    from fsd_cli.main import main
    from sim.profile import DEFAULT_PROFILE_PATH, HANDMADE_2THREADS_PROFILE_PATH

    slo = SLOSpec.default()
    path = tmp_path / "ticks.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"runs": [
        {"name": "slo", "round": 0, "history": recorded_history({"policy": "slo"}, slo)}]}).encode()))
    base = ["sim", "decisions", "--history", str(path)]
    assert main(base + ["--json", str(tmp_path / "out.json")]) == 0
    run = json.loads(capsys.readouterr().out)["runs"]["slo:0"]
    assert run["differ"] == 0 and run["same"] >= 100 and run["from_policy_start"]
    assert len(json.loads((tmp_path / "out.json").read_text())["ticks"]["slo:0"]) == run["ticks"]
    assert main(base + ["--profile", str(HANDMADE_2THREADS_PROFILE_PATH)]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["slo:0"]["differ"] == 0
    assert main(base + ["--profile", str(DEFAULT_PROFILE_PATH)]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["slo:0"]["differ"] > 0
    assert main(base + ["--policy", "static:0"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["slo:0"]["differ"] > 0
    assert main(base + ["--run", "plain:0"]) == 2
    assert "no run ['plain:0']" in capsys.readouterr().err
    assert main(base + ["--div", "kl"]) == 2
    assert "--div picks the divergence of --profile's model" in capsys.readouterr().err
