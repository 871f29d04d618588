"""benchmarks/target_dtype.py: the target's compute dtype compared on the same seeded requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "target_dtype.py"


def test_every_point_is_measured_for_every_dtype(tmp_path: Path) -> None:
    out = tmp_path / "dtype.json"
    subprocess.run([sys.executable, str(SCRIPT), "--pair", "tiny", "--dtypes", "fp32,bf16", "--prompts", "2",
                    "--max-tokens", "3", "--out", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["dtypes"] == ["fp32", "bf16"] and set(report["cpu"]) >= {"capability", "avx512_bf16", "amx_tile"}
    for point in report["points"]:
        for dtype in ("fp32", "bf16"):
            row = point[dtype]
            assert row["tokens_per_s"] > 0
            if point["k"] == 0:  # plain decoding drafts nothing and never shares a cache
                assert row["acceptance_rate"] is None and row["share_kv"] is False
            else:
                assert 0.0 <= row["acceptance_rate"] <= 1.0
            if point["threshold"] == 0:
                assert row["distortion_per_token"] == 0.0  # T = 0 is exact in either dtype


def test_an_unknown_dtype_is_refused_by_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--pair", "tiny", "--dtypes", "fp32,float7", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "float7" in done.stderr
    assert not (tmp_path / "x.json").exists()
