"""The traffic recorder (no Ray): rows, rotation within the size bound, statuses, no text recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import parse_config
from controller.recording import RECORDING_HEADER, RequestRecording, TrafficRecord, TrafficRecorder
from sim.trace import read_azure_trace


def _record(i: int, status: str = "stop") -> TrafficRecord:
    return TrafficRecord(1_700_000_000.0 + i, 10 + i, 20 + i, "standard", 64, status)


def test_rows_read_back_as_a_trace(tmp_path: Path) -> None:
    rec = TrafficRecorder(tmp_path / "r.csv", max_bytes=100_000, backups=1)
    for i in range(5):
        rec.record(_record(i))
    rec.close()
    t = read_azure_trace(tmp_path / "r.csv")
    assert list(t.prompt_tokens) == [10, 11, 12, 13, 14]
    assert list(t.output_tokens) == [20, 21, 22, 23, 24]
    assert list(t.arrival_s) == pytest.approx([0, 1, 2, 3, 4])
    assert t.tier == ("standard",) * 5 and t.status == ("stop",) * 5


def test_rotation_keeps_every_file_under_the_bound_and_drops_the_oldest(tmp_path: Path) -> None:
    max_bytes = 400
    rec = TrafficRecorder(tmp_path / "r.csv", max_bytes=max_bytes, backups=2)
    for i in range(100):
        rec.record(_record(i))
    files = rec.files()
    assert [f.name for f in files] == ["r.csv.2", "r.csv.1", "r.csv"]
    assert all(f.stat().st_size <= max_bytes for f in files)
    assert all(f.read_text().splitlines()[0] == RECORDING_HEADER for f in files)
    # The fetched recording is one CSV, oldest first, ending with the newest row; older rows were dropped.
    whole = tmp_path / "whole.csv"
    whole.write_text(rec.read_all())
    t = read_azure_trace(whole)
    assert 0 < len(t) < 100
    assert int(t.prompt_tokens[-1]) == 10 + 99
    assert list(t.prompt_tokens) == list(range(10 + 100 - len(t), 10 + 100))  # contiguous: nothing lost in between
    rec.close()


def test_restart_appends_to_its_own_file_and_moves_a_foreign_one_aside(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    a = TrafficRecorder(path, max_bytes=10_000, backups=1)
    a.record(_record(0))
    a.close()
    b = TrafficRecorder(path, max_bytes=10_000, backups=1)
    b.record(_record(1))
    b.close()
    assert len(read_azure_trace(path)) == 2
    path.write_text("something,else\n1,2\n")
    c = TrafficRecorder(path, max_bytes=10_000, backups=1)
    c.close()
    assert (tmp_path / "r.csv.1").read_text().startswith("something")
    assert path.read_text() == RECORDING_HEADER + "\n"


def test_request_recording_statuses_and_no_text(tmp_path: Path) -> None:
    cfg = parse_config({"recording": {"enabled": True, "path": str(tmp_path / "r.csv")}})
    rec = TrafficRecorder.from_config(cfg.recording)
    assert rec is not None
    secret = "the prompt text must never be written"
    payload = {"prompt": secret, "max_tokens": None, "tier": None}
    done = RequestRecording.for_payload(rec, payload, cfg)
    done.observe({"type": "start", "prompt_tokens": 7, "tier": "standard"})
    done.observe({"type": "delta", "text": secret})
    done.observe({"type": "end", "finish_reason": "length", "text": secret,
                  "usage": {"prompt_tokens": 7, "completion_tokens": 128}})
    done.close()
    done.close()  # idempotent: one row per request
    cut = RequestRecording.for_payload(rec, {**payload, "tier": "economy", "max_tokens": 50}, cfg)
    cut.observe({"type": "start", "prompt_tokens": 9, "tier": "economy"})
    cut.observe({"type": "delta", "text": "x"})
    cut.observe({"type": "delta", "text": "y"})
    cut.close()  # the client went away before the end chunk
    RequestRecording.for_payload(rec, payload, cfg).refused(503)
    RequestRecording.for_payload(rec, payload, cfg).refused(400)  # invalid: not traffic, not recorded
    RequestRecording.for_payload(rec, payload, cfg).refused(500)
    rec.close()
    text = (tmp_path / "r.csv").read_text()
    assert secret not in text and "x" not in text.split("\n", 1)[1]
    t = read_azure_trace(tmp_path / "r.csv")
    assert t.status == ("length", "cut", "rejected", "error")
    assert list(t.prompt_tokens) == [7, 9, 0, 0]
    assert list(t.output_tokens) == [128, 2, 0, 0]
    default = cfg.replica.default_max_new_tokens
    assert list(t.max_tokens) == [default, 50, default, default]
    assert t.tier == ("standard", "economy", "standard", "standard")


def test_recording_config_is_off_by_default_and_validated(tmp_path: Path) -> None:
    assert TrafficRecorder.from_config(parse_config({}).recording) is None
    cfg = parse_config({"recording": {"enabled": True, "path": "rel/rec.csv"}})
    assert Path(cfg.recording.path).is_absolute()
    with pytest.raises(ValueError, match="recording.max_bytes"):
        parse_config({"recording": {"max_bytes": 10}})
    with pytest.raises(ValueError, match="recording.bogus"):
        parse_config({"recording": {"bogus": 1}})


def test_fsd_sim_compare_replays_a_recording_with_the_live_policy_as_baseline(tmp_path: Path, capsys) -> None:
    import json

    import yaml

    from fsd_cli.main import main

    rec = TrafficRecorder(tmp_path / "rec.csv", max_bytes=100_000, backups=0)
    for i in range(30):
        rec.record(TrafficRecord(1_700_000_000.0 + 0.7 * i, 40 + i, 10 + i, ["standard", "economy"][i % 2], 64,
                                 "stop"))
    rec.close()
    config = tmp_path / "fsd.yaml"
    config.write_text(yaml.safe_dump({"control": {"policy": {"policy": "static", "thresholds": 0.0,
                                                             "guards": False}},
                                      "serve": {"num_replicas": 1}, "model": {"max_batch_size": 4}}))
    out = tmp_path / "cmp.json"
    rc = main(["sim", "compare", "--trace", str(tmp_path / "rec.csv"), "--config", str(config),
               "--policies", "static:0.5,pid", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| live | standard |" in printed and "| pid | economy |" in printed
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["rows"]] == ["live", "static:0.5", "pid"]
    assert report["rows"][0]["baseline"] and not report["rows"][1]["baseline"]
    assert report["live_policy"]["policy"] == "static"
    for row in report["rows"]:
        assert row["completed"] + row["rejected"] <= 30
        assert set(row["tiers"]) == {"standard", "economy"}
        assert row["tiers"]["standard"]["arrivals"] == 15
    assert report["rows"][0]["mean_distortion"] == 0.0  # live = static T 0: lossless
    assert report["runs"]["live"]["summary"]["requests"] == 30
    assert report["runs"]["live"]["meta"]["config"]["max_batch"] == 4


def test_fsd_sim_replay_refuses_resampling_flags(tmp_path: Path, capsys) -> None:
    from fsd_cli.main import main

    rc = main(["sim", "compare", "--trace", "x.csv", "--config", "y.yaml", "--sample", "0.5"])
    assert rc == 2
    assert "--config replays the recording exactly" in capsys.readouterr().err


def test_sim_inputs_map_the_fleet_and_autoscaling() -> None:
    from controller.rollout import sim_inputs

    cfg = parse_config({"model": {"max_batch_size": 4, "num_draft_tokens": 3, "div": "kl"},
                        "replica": {"max_queued": 20}, "serve": {"num_replicas": 3},
                        "control": {"interval_s": 0.5, "policy": "static:0.5"}})
    inputs = sim_inputs(cfg, seed=7)
    c = inputs.config
    assert (c.replicas, c.max_batch, c.max_queue, c.k, c.control_interval_s, c.seed) == (3, 4, 16, 3, 0.5, 7)
    assert inputs.live_policy == "static:0.5" and c.autoscaler is None
    auto = parse_config({"serve": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 5,
                                                          "target_ongoing_requests": 6, "look_back_period_s": 3}}})
    inputs = sim_inputs(auto)
    assert inputs.config.replicas == 2 and inputs.config.autoscaler is not None
    assert inputs.config.autoscaler.max_replicas == 5
    assert any("look_back_period_s" in n for n in inputs.notes)
    assert sim_inputs(auto, replicas=4).config.replicas == 4  # an explicit count replaces autoscaling
    # The hand-off: with autoscaling the live policy's Decision.replicas drives Serve, so the simulator
    # honours it too, within Serve's bounds; off, or with a fixed fleet, neither does.
    assert inputs.replica_bounds == (2, 5) and inputs.config.honour_policy_replicas
    assert sim_inputs(auto, replicas=4).replica_bounds is None
    off = parse_config({"serve": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}},
                        "control": {"steer_replicas": False}})
    assert sim_inputs(off).replica_bounds is None and not sim_inputs(off).config.honour_policy_replicas
    assert sim_inputs(cfg).replica_bounds is None and not sim_inputs(cfg).config.honour_policy_replicas


def test_shadow_estimate_per_tier_cached_and_never_raising(tmp_path: Path) -> None:
    import asyncio
    import time

    from controller.rollout import ShadowEstimator, live_policy_spec

    cfg = parse_config({"control": {"policy": {"policy": "static", "thresholds": 0.0, "guards": False}},
                        "recording": {"enabled": True, "path": str(tmp_path / "r.csv"), "shadow_every_s": 60}})
    rec = TrafficRecorder.from_config(cfg.recording)
    assert rec is not None
    now = time.time()
    for i in range(20):
        rec.record(TrafficRecord(now - 30 + i, 50, 40, ["standard", "economy"][i % 2], 64, "stop"))
    rec.record(TrafficRecord(now - 10_000, 50, 40, "standard", 64, "stop"))  # outside the window
    shadow_spec = {"policy": "static", "thresholds": {"standard": 1.0, "economy": 4.0}, "guards": False}
    status = {"slo": cfg.slo.model_dump(mode="json"), "thresholds": {"standard": 0.0, "economy": 0.0, "lossless": 0.0},
              "policy": {"spec": live_policy_spec(cfg)}, "shadow_policy": {"spec": shadow_spec},
              "last_shadow_decision": {"thresholds": {"standard": 1.0, "economy": 4.0}}, "replicas": [{}]}
    est = ShadowEstimator(cfg, rec)
    report = asyncio.run(est.estimate(status))
    assert report is not None and report["requests"] == 20
    eco = report["tiers"]["economy"]
    assert eco["shadow_would_set"] == 4.0 and eco["live_threshold"] == 0.0
    assert eco["live"]["mean_distortion"] == 0.0 < eco["shadow"]["mean_distortion"]
    assert eco["shadow"]["sim_mean_threshold"] == pytest.approx(4.0)
    assert asyncio.run(est.estimate(status)) is report  # cached within shadow_every_s
    assert asyncio.run(est.estimate({**status, "shadow_policy": None})) is None
    broken = {**status, "shadow_policy": {"spec": {"policy": "nonesuch"}}}
    assert "no estimate" in asyncio.run(est.estimate(broken))["error"]
    assert "recording is off" in asyncio.run(ShadowEstimator(cfg, None).estimate(status))["error"]
    rec.close()
