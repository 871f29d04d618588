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
