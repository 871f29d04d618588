"""Fidelity harness, short: the simulator with a profile calibrated for the tiny pair against the real service.

What is checked here does not depend on the machine's speed: the harness runs both legs, both see exactly
the same requests and output lengths, the report is well formed (every error figure present, a number or
None), a static policy holds T on both legs, and ``--resim`` reproduces a stored report exactly. How close
the simulator's timings come to the real ones is a measurement, not a pass/fail property of the code: a busy
machine moves it (a 10 s tiny-pair run measured −68 % p95 TPOT under CPU contention). It is reported by
``benchmarks/fidelity.py`` (JSON, docs/calibration.md).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from decoder.calibration import CalibrationSettings
from fsd_cli.calibrate import calibrate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import fidelity  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]

APP = "fsd-fidelity"
#: The error figures a report carries, (sim − real) / real: throughput and p50/p95 of each latency metric.
ERROR_KEYS = {"output_tokens_per_s"} | {f"{m}_{q}" for m in fidelity.METRICS for q in ("p50", "p95")}


@pytest.fixture(scope="module")
def tiny_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A profile of the tiny pair the service loads, measured at the replica's 1 torch thread."""
    import torch

    from decoder.models import tiny_pair

    settings = CalibrationSettings.quick(
        thresholds={"kl": (0.0, 0.5, 1.0, 2.0)}, prompts=8, max_new_tokens=48, batch_sizes=(1, 2, 4), timing_iterations=4,
        timing_prompt_tokens=32, prefill_lengths=(16, 64),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profile = calibrate(tiny_pair(), settings, command="tests/controller/test_fidelity.py")
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("fidelity") / "tiny.json"
    profile.save(path)
    yield path


def test_simulator_tracks_the_real_service_on_the_tiny_pair(ray_serve, tiny_profile_path: Path,
                                                            tmp_path: Path) -> None:
    from ray import serve

    from controller.app import build_app

    args = fidelity.build_parser().parse_args([
        "--pair", "tiny", "--profile", str(tiny_profile_path), "--scenarios", "steady", "--duration-s", "10",
        "--rate", "1.5", "--output-tokens", "160,200", "--interval", "0.25",
        "--max-batch", "4", "--replica-cpus", "0.5", "--request-timeout", "120",
        "--policy", '{"policy": "static", "thresholds": 0.5, "guards": false}',
    ])
    st = fidelity.setup(args, ray_serve.port, app_name=APP, route_prefix="/fidelity")
    serve.run(build_app(st.config), name=APP, route_prefix="/fidelity")
    try:
        report = fidelity.run_scenarios(f"{ray_serve.base_url}/fidelity", st, args)
    finally:
        serve.delete(APP)
    row = report["table"][0]
    real, sim, err = row["real"], row["sim"], row["error"]
    assert real["requests"] >= 5
    assert real["completed"] == real["requests"], "every request must be answered"
    assert sim["completed"] == real["requests"], "the simulator replays exactly the real requests"
    assert real["output_tokens"] == sim["output_tokens"], "same output lengths on both legs"
    # Well formed: every figure present; the error is a finite number wherever both legs have the metric.
    assert set(err) == ERROR_KEYS
    for metric in ("tpot_ms_p95", "e2e_ms_p95", "output_tokens_per_s"):
        assert err[metric] is not None and math.isfinite(err[metric]), (metric, row)
    for leg in (real, sim):
        assert leg["output_tokens_per_s"] > 0 and leg["tpot_ms"]["p95"] > 0 and leg["e2e_ms"]["p95"] > 0, leg
    # A static policy: both legs hold T at 0.5 the whole run.
    traj = row["threshold_trajectory"]
    assert traj["sim_mean"] == pytest.approx(0.5) and traj["real_mean"] == pytest.approx(0.5, abs=0.05)
    decomposition = row["decomposition"]
    assert decomposition is not None and decomposition["iterations"] > 0
    # A static T: the profile over the requests' own T is the profile at their mean T.
    assert decomposition["tokens_per_row_iteration_profile_over_requests"] == pytest.approx(
        decomposition["tokens_per_row_iteration_profile"])
    # The simulator leg's own tokens per row-iteration, counted as the replica counts them, beside the service's.
    assert decomposition["tokens_per_row_iteration_sim"] >= 1.0
    assert math.isfinite(decomposition["tokens_per_iteration_sim_rel_error"])
    # The serving overhead, measured apart before the legs: every probe answered, and the client's time holds
    # the engine's busy time for it.
    overhead = report["serving_overhead"]
    assert len(overhead["probes"]) == args.probes
    assert all(p["client_ms"] > p["engine_busy_ms"] > 0 for p in overhead["probes"]), overhead
    assert overhead["ms"] > 0 and args.serving_overhead_ms == overhead["ms"]

    # --resim on the stored report: the same real leg, and (same profile, seed, policy) the same sim leg.
    args.out = str(tmp_path / "report.json")
    fidelity.write_report(report, args)
    again = fidelity.run(fidelity.build_parser().parse_args(
        ["--resim", args.out, "--out", str(tmp_path / "resim.json")]))
    assert again["resimulated_from"]["report"] == args.out
    redo = again["table"][0]
    assert redo["real"] == real and redo["sim"] == sim and redo["error"] == err
    assert again["serving_overhead"]["ms"] == overhead["ms"]
    # Without the overhead the simulator's first tokens come exactly that much sooner (its engine runs the same).
    bare = fidelity.run(fidelity.build_parser().parse_args(
        ["--resim", args.out, "--serving-overhead-ms", "0", "--out", str(tmp_path / "bare.json")]))["table"][0]["sim"]
    assert bare["ttft_ms"]["p50"] == pytest.approx(sim["ttft_ms"]["p50"] - overhead["ms"], abs=1e-6)
    assert bare["tpot_ms"] == sim["tpot_ms"]
    # Simulator replications: the first is the run above; the error is the mean of theirs.
    three = fidelity.run(fidelity.build_parser().parse_args(
        ["--resim", args.out, "--sim-seeds", "3", "--out", str(tmp_path / "three.json")]))["table"][0]
    assert len(three["error_by_sim_seed"]) == 3 and three["error_by_sim_seed"][0] == err
    for key in ("tpot_ms_p95", "e2e_ms_p95"):
        assert three["error"][key] == pytest.approx(sum(e[key] for e in three["error_by_sim_seed"]) / 3)
