"""benchmarks/load_pool.py: per-seed differences are each report's own attainments under the names given for it,
the pooled counts and the exact sign test follow from them, and a name a report did not run is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.load_pool import main
from benchmarks.stats import sign_test_p


def _report(tmp_path: Path, seed: int, configs: dict[str, float], held: dict[str, bool]) -> str:
    path = tmp_path / f"s{seed}.json"
    path.write_text(json.dumps({"seed": seed, "criterion": {"held": held}, "configs": [
        {"name": n, "slo_attainment": a, "mean_distortion_per_token": 0.1} for n, a in configs.items()]}))
    return str(path)


def test_sign_test_is_the_exact_binomial() -> None:
    from scipy.stats import binomtest

    assert sign_test_p(5, 0) == pytest.approx(2 / 32)
    for wins, losses in ((7, 2), (1, 9), (4, 4), (12, 3)):
        assert sign_test_p(wins, losses) == pytest.approx(binomtest(wins, wins + losses, 0.5).pvalue)
    assert sign_test_p(3, 1) == pytest.approx(2 * 5 / 16)
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(2, 2) == 1.0


def test_pooled_over_reports_with_names_per_report(tmp_path: Path) -> None:
    runs = [
        _report(tmp_path, 1, {"slo": 0.90, "hold4": 0.95}, {"slo": False, "hold4": True}) + ":hold4:slo",
        _report(tmp_path, 2, {"slo": 0.97, "relax0": 0.96}, {"slo": True, "relax0": True}) + ":slo:relax0",
        _report(tmp_path, 3, {"slo": 0.80, "relax0": 0.80}, {"slo": False, "relax0": False}) + ":slo:relax0",
        _report(tmp_path, 4, {"slo": 0.70, "relax0": 0.75}, {}) + ":slo:relax0",
    ]
    out = tmp_path / "out.json"
    assert main([*runs, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    diffs = [s["difference"] for s in result["seeds"]]
    assert diffs == pytest.approx([0.05, 0.01, 0.0, -0.05])
    pooled = result["pooled"]
    assert (pooled["wins"], pooled["ties"], pooled["losses"]) == (2, 1, 1)
    assert pooled["sign_test_p"] == pytest.approx(1.0)
    assert pooled["mean_difference"] == pytest.approx(0.0025)
    assert pooled["ci95"] > 0 and math.isfinite(pooled["ci95"])
    assert (pooled["held_a"], pooled["held_b"]) == (2, 1)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    path = _report(tmp_path, 1, {"slo": 0.9}, {})
    with pytest.raises(SystemExit, match="no configuration 'relax0'.*'slo'"):
        main([f"{path}:slo:relax0"])
    with pytest.raises(SystemExit, match="give REPORT:A:B"):
        main([f"{path}:slo"])
    with pytest.raises(SystemExit, match="missing.json"):
        main([f"{tmp_path / 'missing.json'}:a:b"])
