"""End to end on vLLM: the default pair's target with a layer-truncated draft, sampled, through vLLM's
``LLM`` with the plugin loaded by vLLM itself. At T = 0 nothing is fuzzy; with div ``tv`` and T = 1 every
draft passes the fuzzy test, so fuzzy acceptances and distortion must show in the counters.

Slow (one vLLM engine start, minutes on 2 busy cores); skipped without ``.venv-vllm`` or the converted model.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fsd_vllm.offline import default_target_dir

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run `make vllm-env`)"),
    pytest.mark.skipif(
        not (default_target_dir() / "config.json").exists(),
        reason=f"no converted default target at {default_target_dir()} (load the default pair once: fsd demo)",
    ),
]


def test_sampled_fsd_on_vllm_shows_fuzzy_acceptances_only_above_zero_threshold() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", FSD_VLLM_DIV="tv")
    command = [
        str(VLLM_PYTHON), "-m", "fsd_vllm.offline", "--k", "3", "--draft-layers", "24", "--batch", "1",
        "--temperature", "0.8", "--threshold", "0", "1.0", "--max-tokens", "16",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd="/tmp", env=env, timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FSD_VLLM_RUNS ")]
    assert done.returncode == 0 and lines, f"rc={done.returncode}\n{done.stderr[-4000:]}"
    runs = {run["threshold"]: run for run in json.loads(lines[-1].removeprefix("FSD_VLLM_RUNS "))["runs"]}
    exact, fuzzy = runs[0.0]["counters"], runs[1.0]["counters"]
    assert runs[0.0]["generated_tokens"] == runs[1.0]["generated_tokens"] == 16
    assert exact["drafted"] > 0 and exact["fuzzy_accepted"] == 0 and exact["distortion"] == 0.0
    # tv <= 1 = T: every drafted token is accepted, those the standard test would reject are fuzzy
    assert fuzzy["accepted"] == fuzzy["drafted"] > 0
    assert fuzzy["fuzzy_accepted"] > 0 and fuzzy["distortion"] > 0.0
    assert all(text.strip() for text in runs[1.0]["texts"])
