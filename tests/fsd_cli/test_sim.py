"""`fsd sim` and `fsd sim compare` through the real CLI entry point."""

import json

import pytest

from fsd_cli.main import main
from sim.profile import HANDMADE_2THREADS_PROFILE_PATH, Profile

WORKLOAD = """name: cli
duration_s: 120
arrivals: {kind: poisson, rate: 0.5}
prompt_tokens: {kind: fixed, value: 100}
output_tokens: {kind: fixed, value: 60}
"""


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(WORKLOAD)
    return path


def test_sim_run_writes_json_plot_and_records(tmp_path, workload, capsys) -> None:
    out, png, npz = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.npz"
    rc = main(["sim", "--workload", str(workload), "--policy", "pid", "--seed", "3", "--json", str(out),
               "--plot", str(png), "--records", str(npz), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    s = data["summary"]
    for key in ("slo_attainment", "goodput_rps", "ttft_ms", "tpot_ms", "e2e_ms", "mean_distortion",
                "replica_seconds", "cost_per_1k_tokens", "completed", "rejected"):
        assert key in s
    assert s["completed"] + s["rejected"] == s["requests"]
    assert len(data["timeseries"]["time_s"]) > 50
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert npz.stat().st_size > 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["summary"] == s


def test_sim_same_seed_same_output(tmp_path, workload) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert main(["sim", "--workload", str(workload), "--seed", "5", "--json", str(path), "--quiet"]) == 0
    assert json.loads(a.read_text()) == json.loads(b.read_text())


def test_sim_compare_prints_a_table(tmp_path, workload, capsys) -> None:
    out = tmp_path / "c.json"
    png = tmp_path / "c.png"
    rc = main(["sim", "compare", "--workload", str(workload), "--policies", "static:0,static:1.0,pid",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| policy |" in text and "| static:1.0 |" in text and "| pid |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["static:0", "static:1.0", "pid"]
    assert rows[0]["mean_distortion"] == 0.0 < rows[1]["mean_distortion"]
    assert png.exists()


def test_policy_and_slo_from_files(tmp_path, workload) -> None:
    pol = tmp_path / "p.yaml"
    pol.write_text("policy: static\nthresholds: 0.75\n")
    slo = tmp_path / "slo.yaml"
    slo.write_text("tiers:\n  standard: {tpot_ms: 80}\ndefault_tier: standard\n")
    out = tmp_path / "o.json"
    assert main(["sim", "--workload", str(workload), "--policy", str(pol), "--slo", str(slo),
                 "--json", str(out), "--quiet"]) == 0
    ts = json.loads(out.read_text())["timeseries"]
    assert set(ts["T_standard"]) == {0.75}


def test_trace_flag(tmp_path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" +
                     "".join(f"{i * 2.0},{100 + i},{20 + i}\n" for i in range(40)))
    out = tmp_path / "o.json"
    assert main(["sim", "--trace", str(trace), "--time-scale", "0.5", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["requests"] == 40
    assert "Splitwise" in data["meta"]["attribution"]
    assert any("time_scale=0.5" in n for n in data["meta"]["notes"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policy", "wobble"], "unknown policy"),
        (["--policy", '{"policy": "pid", "kp": "high"}'], "pid.kp"),
        (["--replicas", "0"], "replicas"),
        (["--duration", "-5"], "duration_s"),
    ],
)
def test_bad_inputs_exit_2_naming_the_field(workload, capsys, args, needle) -> None:
    rc = main(["sim", "--workload", str(workload), "--quiet", *args])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_bad_slo_and_profile_files_name_the_field(tmp_path, workload, capsys) -> None:
    slo = tmp_path / "slo.yaml"
    slo.write_text("tiers:\n  standard: {tpot_ms: -3}\n")
    assert main(["sim", "--workload", str(workload), "--slo", str(slo), "--quiet"]) == 2
    assert "tpot_ms" in capsys.readouterr().err
    prof = tmp_path / "p.json"
    prof.write_text('{"schema_version": 1}')
    assert main(["sim", "--workload", str(workload), "--profile", str(prof), "--quiet"]) == 2
    assert "provenance" in capsys.readouterr().err


def test_sim_warns_when_a_tier_target_is_out_of_the_profiles_reach(workload, capsys, tmp_path) -> None:
    # A replica twice as slow as the calibrated default (session 10's calibration was) cannot reach the
    # standard tier's 60 ms p95 TPOT at any allowed T; the hand-made two-thread profile can. The warning
    # says which and why.
    default = Profile.default()
    slow = default.model_copy(update={"latency": default.latency.model_copy(update={
        key: 2 * value if isinstance(value, float) else [2 * v for v in value] if isinstance(value, list) else value
        for key, value in default.latency.model_dump().items()})})
    slow_path = tmp_path / "slow.json"
    slow_path.write_text(slow.model_dump_json())
    assert main(["sim", "--workload", str(workload), "--policy", "static:1.0", "--profile", str(slow_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: tier 'standard': p95 TPOT target 60 ms is below this profile's best case" in err
    assert "'economy'" not in err
    assert main(["sim", "--workload", str(workload), "--policy", "static:1.0",
                 "--profile", str(HANDMADE_2THREADS_PROFILE_PATH)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_sim_model_writes_the_operating_model_a_policy_spec_can_name(tmp_path, capsys) -> None:
    from dataclasses import replace

    from policies.operating_model import DEFAULT_MODEL_PATH, OperatingModel
    from policies.registry import make_policy
    from policies.slo import SLOSpec
    from sim.profile import DEFAULT_PROFILE_PATH

    out = tmp_path / "model.json"
    assert main(["sim", "model", "--profile", str(DEFAULT_PROFILE_PATH), "--out", str(out)]) == 0
    written = OperatingModel.load(out)
    shipped = OperatingModel.load(DEFAULT_MODEL_PATH)
    assert replace(written, source=shipped.source) == shipped  # the shipped model is this profile's
    policy = make_policy({"policy": "slo", "model": str(out)}, SLOSpec.default())
    assert policy is not None
    capsys.readouterr()
    assert main(["sim", "model", "--profile", str(DEFAULT_PROFILE_PATH)]) == 2
    assert "--out" in capsys.readouterr().err
