from pathlib import Path

import numpy as np
import pytest

from policies.slo import SLOSpec
from sim.trace import AZURE_ATTRIBUTION, read_azure_trace

from .conftest import make_workload, run_sim

AZURE_SAMPLE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:55.0000000,5000,300
2023-11-16 18:16:01.5000000,120,0
"""


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "azure_sample.csv"
    path.write_text(AZURE_SAMPLE)
    return path


def test_reads_the_azure_format(tmp_path) -> None:
    t = read_azure_trace(_write(tmp_path))
    assert len(t) == 6
    assert t.arrival_s[0] == 0.0
    assert t.arrival_s[1] == pytest.approx(50.9951690 - 46.6805900)
    assert t.arrival_s[-1] == pytest.approx(61.5 - 46.68059)
    assert list(t.prompt_tokens[:2]) == [374, 396]
    assert list(t.output_tokens[-2:]) == [300, 0]


def test_time_scaling_clipping_and_notes(tmp_path) -> None:
    w = make_workload(
        duration_s=None,
        arrivals={"kind": "trace", "path": str(_write(tmp_path)), "time_scale": 0.5},
        prompt_tokens={"kind": "trace"},
        output_tokens={"kind": "trace"},
        max_context=1024,
    )
    r = w.generate(np.random.default_rng(0), ["standard"], "standard")
    raw = read_azure_trace(tmp_path / "azure_sample.csv")
    assert np.allclose(r.arrival_s, raw.arrival_s * 0.5)
    assert r.prompt_tokens.max() == 1023  # the 5000-token prompt, clipped
    assert r.output_tokens.min() == 1  # GeneratedTokens = 0 becomes one token
    joined = " ".join(r.notes)
    assert "clipped to max_context=1024: 1 prompts and 1 outputs" in joined
    assert "time_scale=0.5" in joined
    assert r.attribution == AZURE_ATTRIBUTION


def test_duration_and_sampling_cut_the_trace(tmp_path) -> None:
    base = {"kind": "trace", "path": str(_write(tmp_path))}
    w = make_workload(duration_s=5.0, arrivals=base, prompt_tokens={"kind": "trace"},
                      output_tokens={"kind": "trace"})
    assert len(w.generate(np.random.default_rng(0), ["standard"], "standard")) == 4  # offsets < 5 s
    sampled = make_workload(duration_s=None, arrivals={**base, "sample_fraction": 0.5},
                            prompt_tokens={"kind": "trace"}, output_tokens={"kind": "trace"})
    sizes = {len(sampled.generate(np.random.default_rng(s), ["standard"], "standard")) for s in range(20)}
    assert min(sizes) < 6 and max(sizes) <= 6


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("TIME,ContextTokens,GeneratedTokens\n1,2,3\n", "missing column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,2,3\n", "line 2"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,two,3\n", "ContextTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no rows"),
    ],
)
def test_malformed_trace_is_a_value_error(tmp_path, text, needle) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        read_azure_trace(path)


def test_trace_replay_runs_end_to_end_with_attribution(tmp_path) -> None:
    w = make_workload(duration_s=None, arrivals={"kind": "trace", "path": str(_write(tmp_path))},
                      prompt_tokens={"kind": "trace"}, output_tokens={"kind": "trace"})
    res = run_sim(w, slo=SLOSpec.default())
    assert res.summary["completed"] + res.summary["rejected"] == 6
    assert res.meta["attribution"] == AZURE_ATTRIBUTION


def test_shared_trace_when_present() -> None:
    """The real trace beside the repo (CI: ../shared); skipped when the clone stands alone."""
    path = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_conv.csv"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    t = read_azure_trace(path)
    assert len(t) > 19000 and t.arrival_s[-1] > 3000


RECORDED_SAMPLE = """TIMESTAMP,ContextTokens,GeneratedTokens,Tier,MaxTokens,Status
1700000000.500000,12,30,economy,64,stop
1700000000.000000,20,64,,64,length
1700000001.250000,0,0,standard,128,rejected
1700000002.000000,8,3,lossless,32,cut
"""


def test_reads_the_optional_recorded_columns_sorted_with_the_rows(tmp_path) -> None:
    path = tmp_path / "rec.csv"
    path.write_text(RECORDED_SAMPLE)
    t = read_azure_trace(path)
    assert list(t.arrival_s) == pytest.approx([0.0, 0.5, 1.25, 2.0])
    assert t.tier == (None, "economy", "standard", "lossless")  # empty Tier = the default tier
    assert list(t.max_tokens) == [64, 64, 128, 32]
    assert t.status == ("length", "stop", "rejected", "cut")
    assert list(t.output_tokens) == [64, 30, 0, 3]


def test_plain_azure_trace_has_no_optional_columns(tmp_path) -> None:
    t = read_azure_trace(_write(tmp_path))
    assert t.tier is None and t.max_tokens is None and t.status is None


@pytest.mark.parametrize("row, column", [("1,2,3,standard,x,stop", "MaxTokens"), ("1,2,3,standard,-1,stop", "MaxTokens"),
                                         ("1,2,3,standard,4,done", "Status")])
def test_bad_optional_column_names_line_and_column(tmp_path, row: str, column: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Tier,MaxTokens,Status\n" + row + "\n")
    with pytest.raises(ValueError, match=f"line 2: {column}"):
        read_azure_trace(path)


def test_write_then_read_round_trips_optional_columns(tmp_path) -> None:
    from sim.trace import write_azure_trace

    path = tmp_path / "rt.csv"
    write_azure_trace(path, np.array([0.0, 1.5]), np.array([5, 6]), np.array([7, 8]), tier=["economy", None],
                      max_tokens=np.array([16, 0]), status=["stop", "cut"])
    t = read_azure_trace(path)
    assert t.tier == ("economy", None) and list(t.max_tokens) == [16, 0] and t.status == ("stop", "cut")


def test_workload_uses_trace_tiers_and_caps_sampled_lengths_by_max_tokens(tmp_path) -> None:
    path = tmp_path / "rec.csv"
    path.write_text(RECORDED_SAMPLE)
    slo = SLOSpec.default()
    w = make_workload(duration_s=None, arrivals={"kind": "trace", "path": str(path)},
                      prompt_tokens={"kind": "trace"}, output_tokens={"kind": "fixed", "value": 100})
    r = w.generate(np.random.default_rng(0), list(slo.tiers), slo.default_tier)
    assert [r.tier_names[i] for i in r.tier] == ["standard", "economy", "standard", "lossless"]
    assert list(r.output_tokens) == [64, 64, 100, 32]  # sampled 100, capped by MaxTokens
    assert r.attribution is None  # a recorded trace is not the Azure trace
    with pytest.raises(ValueError, match="Tier 'economy'"):
        w.generate(np.random.default_rng(0), ["standard", "lossless"], "standard")
