"""``benchmarks/refit_latency.py``: a profile's latency refitted from its own calibration record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import refit_latency  # noqa: E402
from sim.profile import DEFAULT_PROFILE_PATH, HANDMADE_2THREADS_PROFILE_PATH, Profile  # noqa: E402


def test_refit_reproduces_the_shipped_fit_and_adds_the_measured_prefills(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "refit.json"
    assert refit_latency.main([str(DEFAULT_PROFILE_PATH), "--shared-kv", "--profile-out", str(out)]) == 0
    shipped, refitted = Profile.load(DEFAULT_PROFILE_PATH), Profile.load(out)
    report = json.loads(capsys.readouterr().out)
    # The shipped latency is this record's fit (shared KV): only the measured prefills are new.
    assert set(report["changed"]) == {"prefill_ms_by_tokens"}
    assert refitted.latency.model_copy(update={"prefill_ms_by_tokens": None}) == shipped.latency
    assert refitted.acceptance == shipped.acceptance and refitted.request_acceptance == shipped.request_acceptance
    table = refitted.latency.prefill_ms_by_tokens
    assert table is not None and table[0][0] == 16
    # The line misses the 16-token prompt the table holds (the session-28 finding on this pair).
    assert table[0][1] > 1.2 * (shipped.latency.prefill_fixed_ms + 16 * shipped.latency.prefill_ms_per_token)


def test_refit_needs_the_kv_layout_and_a_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.json")
    assert refit_latency.main([str(DEFAULT_PROFILE_PATH), "--profile-out", out]) == 2
    assert "--shared-kv or --separate-kv" in capsys.readouterr().err
    assert refit_latency.main([str(HANDMADE_2THREADS_PROFILE_PATH), "--shared-kv", "--profile-out", out]) == 2
    assert "no calibration record" in capsys.readouterr().err
    # A record that says how the engine ran: a contradicting flag is refused.
    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    recorded = tmp_path / "recorded.json"
    shipped.model_copy(update={"calibration": {**(shipped.calibration or {}), "draft_shares_kv": True}}).save(recorded)
    assert refit_latency.main([str(recorded), "--separate-kv", "--profile-out", out]) == 2
    assert "contradicts" in capsys.readouterr().err
    assert refit_latency.main([str(recorded), "--profile-out", out]) == 0
