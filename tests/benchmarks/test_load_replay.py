"""benchmarks/load_replay.py: a benchmarks/load.py report's requests replayed in the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.load_replay import replay_report, round_requests, side
from benchmarks.load_sim import load_slo, with_plain_step_scale, with_speculative_step_scale
from sim.profile import DEFAULT_PROFILE_PATH, Profile

ROOT = Path(__file__).resolve().parents[2]
PLAIN = {"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "guards": False}
T4K6 = {"policy": "static", "thresholds": {"economy": 4.0}, "draft_lengths": 6, "guards": False}


def record(arrival_s: float, prompt: int | None = 40, output: int | None = 48) -> dict[str, Any]:
    rec: dict[str, Any] = {"arrival_s": arrival_s, "status": 200 if prompt else 503}
    if prompt:
        rec.update(prompt_tokens=prompt, output_tokens=output, tpot_ms=60.0)
    return rec


def light_report(tpot_ms: float = 97.0) -> dict[str, Any]:
    """Two rounds of plain decoding and T = 4, k = 6 at one request every 6 s (one row at a time)."""
    rounds = [[record(1.0 + 6.0 * i + 0.5 * r) for i in range(6)] for r in range(2)]
    runs = [{"name": name, "round": r, "records": recs, "t_samples": []}
            for r, recs in enumerate(rounds) for name in ("plain", "static:4:6")]
    configs = [{"name": "plain", "spec": PLAIN, "slo_attainment": 1.0, "mean_distortion_per_token": 0.0},
               {"name": "static:4:6", "spec": T4K6, "slo_attainment": 1.0, "mean_distortion_per_token": 0.2}]
    return {"tier": "economy", "interval_s": 1.0, "slo": load_slo("economy", tpot_ms).model_dump(),
            "runs": runs, "configs": configs}


def test_round_requests_keeps_the_recorded_requests_and_fills_refused_ones_with_the_median() -> None:
    slo = load_slo("economy", 97.0)
    recs = [record(5.0, 30, 10), record(1.0, 50, 48), record(3.0, None), record(2.0, 40, 20)]
    req = round_requests(recs, slo, "economy")
    assert req.arrival_s.tolist() == [1.0, 2.0, 3.0, 5.0]  # in arrival order, from the round's start
    assert req.prompt_tokens.tolist() == [50, 40, 40, 30]  # the refused request: the median prompt (40)
    assert req.output_tokens.tolist() == [48, 20, 20, 10]  # and the median output (20)
    assert set(req.tier.tolist()) == {list(slo.tiers).index("economy")}
    with pytest.raises(ValueError, match="no requests"):
        round_requests([], slo, "economy")
    with pytest.raises(ValueError, match="'premium'"):
        round_requests(recs, slo, "premium")
    with pytest.raises(ValueError, match="-1.0"):
        round_requests([record(-1.0)], slo, "economy")


def test_plain_step_scale_moves_plain_steps_only() -> None:
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    slow = with_plain_step_scale(profile, 2.0)
    for batch in (1, 3, 8):
        assert float(slow.latency.iteration_ms(batch, 0)) == pytest.approx(2.0 * float(profile.latency.iteration_ms(batch, 0)))
        assert float(slow.latency.iteration_ms(batch, 6)) == pytest.approx(float(profile.latency.iteration_ms(batch, 6)))
    assert slow.latency.prefill_ms(40) == pytest.approx(profile.latency.prefill_ms(40))
    with pytest.raises(ValueError, match="0.0"):
        with_plain_step_scale(profile, 0.0)


def test_speculative_step_scale_moves_draft_and_verify_steps_only() -> None:
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    fast = with_speculative_step_scale(profile, 0.5)
    for batch in (1, 3, 8):
        for k in (2, 6):
            assert float(fast.latency.iteration_ms(batch, k)) == pytest.approx(
                0.5 * float(profile.latency.iteration_ms(batch, k)))
        assert float(fast.latency.iteration_ms(batch, 0)) == pytest.approx(float(profile.latency.iteration_ms(batch, 0)))
    assert fast.latency.prefill_ms(40) == pytest.approx(profile.latency.prefill_ms(40))
    assert fast.latency.draft_catch_up_ms(200) == pytest.approx(profile.latency.draft_catch_up_ms(200))
    with pytest.raises(ValueError, match="-1.0"):
        with_speculative_step_scale(profile, -1.0)


def test_replay_reports_real_and_simulated_figures_and_a_slow_host_fails_plain_decoding_only() -> None:
    report = light_report()
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    fast = {c["name"]: c for c in replay_report(report, profile, profile, seeds=[0])}
    assert fast["plain"]["real"] == {"slo_attainment": 1.0, "mean_distortion_per_token": 0.0}
    assert fast["plain"]["sim"]["slo_attainment"] == 1.0 and fast["plain"]["sim"]["mean_distortion_per_token"] == 0.0
    assert len(fast["plain"]["sim"]["attainment_by_round"]) == 2
    assert fast["static:4:6"]["sim"]["mean_distortion_per_token"] > 0.1
    # Plain steps at 2.5x the calibrated time (~110 ms a token at one row, 44 ms calibrated) miss a 97 ms target; T = 4, k = 6
    # runs no plain step and meets it as before.
    slow = {c["name"]: c for c in replay_report(report, with_plain_step_scale(profile, 2.5), profile, seeds=[0])}
    assert slow["plain"]["sim"]["slo_attainment"] == 0.0
    assert slow["static:4:6"]["sim"] == fast["static:4:6"]["sim"]


def test_replay_cli_writes_the_criterion_on_both_sides_and_refuses_a_report_without_runs(tmp_path: Path) -> None:
    src, out = tmp_path / "load.json", tmp_path / "replay.json"
    src.write_text(json.dumps(light_report()))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_replay.py"), str(src), "--seeds", "0",
                    "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["configs"]] == ["plain", "static:4:6"]
    assert report["criterion"] == {"real": None, "sim": None}  # no adaptive configuration ran: nothing to judge
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**light_report(), "runs": []}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_replay.py"), str(empty), "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "no runs" in done.stderr and "Traceback" not in done.stderr


def test_replay_takes_the_slo_policy_by_name_and_refuses_other_json(tmp_path: Path) -> None:
    report = light_report()
    report["runs"] += [{"name": "slo", "round": r, "records": report["runs"][2 * r]["records"], "t_samples": []}
                       for r in range(2)]
    report["configs"].append({"name": "slo", "spec": {"policy": "pid"}, "slo_attainment": 1.0,
                              "mean_distortion_per_token": 0.0})
    src, out = tmp_path / "load.json", tmp_path / "replay.json"
    src.write_text(json.dumps(report))
    # A bare name is valid JSON ("slo"); it names the policy as load.py's --configs do.
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_replay.py"), str(src), "--seeds", "0",
                    "--slo-policy", '"slo"', "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    replay = json.loads(out.read_text())
    assert {c["name"]: c["spec"] for c in replay["configs"]}["slo"] == {"policy": "slo"}
    assert set(replay["criterion"]["sim"]["held"]) == {"slo"}
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    with pytest.raises(ValueError, match=r"\[1\]"):
        replay_report(report, profile, profile, seeds=[0], slo_policy=[1])  # type: ignore[arg-type]


def test_schedules_replay_on_the_rounds_without_real_figures_and_stay_out_of_the_criterion() -> None:
    report = light_report()  # one request every 6 s: one row at a time
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    schedules = {"trigger:1": {"policy": "trigger", "rows": 1, "hold_s": 100, "high": [4, 6]},
                 "trigger:2": {"policy": "trigger", "rows": 2, "hold_s": 100, "high": [4, 6]}}
    got = {c["name"]: c for c in replay_report(report, profile, profile, seeds=[0], schedules=schedules)}
    assert got["trigger:1"]["real"] == {"slo_attainment": None, "mean_distortion_per_token": None}
    # One row reaches the one-row trigger (it drafts from the first request on) and never the two-row one.
    assert got["trigger:1"]["sim"]["mean_distortion_per_token"] > 0.1
    assert got["trigger:2"]["sim"] == got["plain"]["sim"]
    assert [c["name"] for c in side(list(got.values()), "sim")] == ["plain", "static:4:6"]  # bounds, not candidates
    with pytest.raises(ValueError, match="'plain'"):
        replay_report(report, profile, profile, seeds=[0], schedules={"plain": schedules["trigger:1"]})


def test_extra_configs_replay_as_candidates_and_ttft_counts(tmp_path: Path) -> None:
    """A batch-capped static point that did not run is replayed on the same rounds and judged as a static point
    (sim side only: it has no real figures); with --ttft-ms a cap of one row that queues a burst for longer
    than the target loses the requests that waited, which without the target it did not."""
    report = light_report()
    for run in report["runs"]:  # a burst: the first four requests of each round arrive together
        for rec in run["records"][:4]:
            rec["arrival_s"] = run["records"][0]["arrival_s"]
    cap1 = {"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "batch_cap": 1, "guards": False}
    profile = Profile.load(DEFAULT_PROFILE_PATH)
    got = {c["name"]: c for c in replay_report(report, profile, profile, seeds=[0], extra={"cap1": cap1})}
    assert got["cap1"]["real"]["slo_attainment"] is None and got["cap1"]["sim"]["slo_attainment"] == 1.0
    assert [c["name"] for c in side(list(got.values()), "real")] == ["plain", "static:4:6"]
    assert [c["name"] for c in side(list(got.values()), "sim")] == ["plain", "static:4:6", "cap1"]
    with pytest.raises(ValueError, match="'plain'"):
        replay_report(report, profile, profile, seeds=[0], extra={"plain": cap1})
    src, out = tmp_path / "load.json", tmp_path / "replay.json"
    src.write_text(json.dumps(report))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_replay.py"), str(src), "--seeds", "0",
                    "--ttft-ms", "2000", "--config", "cap1=" + json.dumps(cap1), "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    replay = {c["name"]: c for c in json.loads(out.read_text())["configs"]}
    # Four 48-token requests one after another: each after the first waits at least one request's decode
    # (48 steps of >= 51.6 ms, 2.5 s) past the 2 s target; the two alone meet it.
    assert replay["cap1"]["sim"]["slo_attainment"] == pytest.approx(3 / 6)
    assert replay["plain"]["sim"]["slo_attainment"] == 1.0
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_replay.py"), str(src), "--config",
                          "cap1={", "--out", str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "--config 'cap1={': not JSON" in bad.stderr and "Traceback" not in bad.stderr


def test_several_reports_are_replayed_each_and_pooled(tmp_path: Path) -> None:
    """With several reports: each replayed as alone, and per configuration the simulated − real attainment and
    distortion over them (a report whose real side is slower than the simulator reads a positive error)."""
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    fast.write_text(json.dumps(light_report()))
    report = light_report()
    report["configs"][0]["slo_attainment"] = 0.75  # plain decoding missed a quarter live
    slow.write_text(json.dumps(report))
    out = tmp_path / "pooled.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_replay.py"), str(fast), str(slow), "--seeds", "0",
                    "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    pooled = json.loads(out.read_text())
    assert [r["report"] for r in pooled["reports"]] == [str(fast), str(slow)]
    plain = pooled["pooled"]["plain"]
    sim_plain = [next(c for c in r["configs"] if c["name"] == "plain")["sim"]["slo_attainment"] for r in pooled["reports"]]
    assert plain["reports"] == 2
    assert plain["attainment_error"]["each"] == pytest.approx([sim_plain[0] - 1.0, sim_plain[1] - 0.75], abs=1e-4)
    assert plain["attainment_error"]["each"][1] > plain["attainment_error"]["each"][0]
    assert plain["verdict_agrees"] == "0 of 0"  # no policy ran: nothing judged
    static = pooled["pooled"]["static:4:6"]
    assert static["distortion_error"]["each"] == pytest.approx(
        [next(c for c in r["configs"] if c["name"] == "static:4:6")["sim"]["mean_distortion_per_token"] - 0.2
         for r in pooled["reports"]], abs=1e-4)
