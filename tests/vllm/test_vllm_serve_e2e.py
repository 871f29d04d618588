"""``fsd serve`` with ``model.engine: vllm`` on the default pair, end to end over HTTP.

The real CLI in a subprocess starts its own Ray cluster; Ray runs the replica in ``.venv-vllm``'s interpreter
(``runtime_env.py_executable``) on the dequantized SmolLM2 target with a layer-truncated draft. The test
checks, through the public API only:

* a chat completion answers with the usual OpenAI body and the ``fsd`` object, from a replica process that
  really runs the vLLM environment (its memory maps hold ``.venv-vllm``'s libraries);
* the controller's T reaches vLLM's rejection sampler: a static policy switched over the admin API moves the
  economy tier from T = 0 to T = 1; with divergence ``tv`` (always <= 1) every draft token is then accepted,
  the ones the standard test would have rejected counted as fuzzy with their distortion, while at T = 0
  (before the switch, and the standard tier after it) nothing is fuzzy;
* streaming works, and a client leaving mid-stream frees its slot (the vLLM request is aborted);
* SIGINT stops everything (exit 0).

Slow (a Ray cluster and a vLLM engine start: several minutes on 2 busy cores); skipped without ``.venv-vllm``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.controller.conftest import free_port
from tests.controller.conftest import wait_until as _wait

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
TOKEN = "vllm-e2e-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (run `make vllm-env`)"),
]


def _config(port: int) -> dict[str, Any]:
    return {
        # tv <= 1 always: at T = 1 every draft token passes the fuzzy test, whatever the draft.
        "model": {"engine": "vllm", "div": "tv", "num_draft_tokens": 3, "max_batch_size": 4},
        "replica": {"default_max_new_tokens": 16, "max_new_tokens_limit": 1900},
        # A static policy: T moves only when the test says so (the SLO policy would move it on its own).
        "control": {"interval_s": 0.5, "policy": {"policy": "static", "thresholds": 0.0, "guards": False}},
        "http": {"port": port, "admin_token": TOKEN, "request_timeout_s": 600},
        "ray": {"num_cpus": 2},
        "vllm": {"python": str(VLLM_PYTHON), "max_model_len": 2048},
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(base URL, process) of ``fsd serve`` on engine vllm; stopped with SIGINT at the end."""
    work = tmp_path_factory.mktemp("vllm-serve")
    port = free_port()
    config = work / "vllm.yaml"
    config.write_text(yaml.safe_dump(_config(port)), encoding="utf-8")
    log_path = work / "serve.log"
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fsd_cli", "serve", str(config)], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"fsd serve exited {proc.returncode}:\n{log_path.read_text()[-6000:]}")
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200

    try:
        _wait(up, 1200, "fsd serve with engine vllm answering /healthz")
        _wait(lambda: _status(url)["replicas"], 300, "the vLLM replica reporting to the controller")
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def _chat(url: str, tier: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "Write a haiku about autumn."}], "max_tokens": 24,
            "temperature": 0.8, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-slo-tier": tier}, timeout=600)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _status(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/fsd/status", timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_vllm_replica_answers_and_follows_the_controllers_threshold(served: Any) -> None:
    url, proc, log_path = served
    (replica,) = _status(url)["replicas"]
    maps = Path(f"/proc/{replica['pid']}/maps").read_text()
    assert str(REPO / ".venv-vllm") in maps, "the replica process runs the vLLM environment's interpreter"
    assert replica["pair"] == "smollm2-135m" and replica["draft_lengths"]["economy"] == 3

    exact = _chat(url, "economy")
    assert exact["object"] == "chat.completion" and exact["model"] == "smollm2-135m"
    assert exact["choices"][0]["message"]["content"].strip()
    assert exact["usage"]["completion_tokens"] == 24
    fsd = exact["fsd"]
    assert (fsd["tier"], fsd["threshold"], fsd["replica_id"]) == ("economy", 0.0, replica["replica_id"])
    assert fsd["drafted_tokens"] > 0 and fsd["fuzzy_accepted_tokens"] == 0 and fsd["distortion"] == 0.0

    r = httpx.put(f"{url}/v1/fsd/policy", json={"policy": "static", "thresholds": {"economy": 1.0},
                                                "guards": False}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    _wait(lambda: _status(url)["replicas"][0]["thresholds"]["economy"] == 1.0, 120,
          "the replica reporting economy T = 1.0")

    fuzzy = _chat(url, "economy")["fsd"]
    assert (fuzzy["tier"], fuzzy["threshold"]) == ("economy", 1.0)
    # T reached vLLM's rejection sampler: tv <= 1 = T accepts every drafted token, the fuzzy ones charged.
    assert fuzzy["accepted_tokens"] == fuzzy["drafted_tokens"] > 0
    assert fuzzy["fuzzy_accepted_tokens"] > 0 and fuzzy["distortion"] > 0.0
    # The other tiers kept T = 0.
    standard = _chat(url, "standard")["fsd"]
    assert standard["threshold"] == 0.0 and standard["fuzzy_accepted_tokens"] == 0 and standard["distortion"] == 0.0

    # Streaming: deltas, then a last chunk with the fsd object of the tier's current T.
    events = _stream(url, {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.8,
                           "ignore_eos": True, "stream": True}, tier="economy")
    assert "".join(e["choices"][0]["text"] for e in events).strip()
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["fsd"]["threshold"] == 1.0

    # A client that goes away mid-stream frees its slot (the vLLM request is aborted, not run to the end).
    aborted_before = _metric(url, "fsd_aborted_total")
    _stream(url, {"prompt": "Count to a thousand.", "max_tokens": 1800, "temperature": 0.8, "ignore_eos": True,
                  "stream": True}, tier="standard", stop_after=1)
    _wait(lambda: _metric(url, "fsd_aborted_total") > aborted_before, 120, "the abandoned stream counted as aborted")
    _wait(lambda: _status(url)["replicas"][0]["in_flight"] == 0, 120, "the replica's slot freed")
    assert _chat(url, "standard")["usage"]["completion_tokens"] == 24  # the engine serves on

    # The replica's reports (the plugin's counters) reached the controller: its counters hold these drafts.
    requested = fsd["drafted_tokens"] + fuzzy["drafted_tokens"] + standard["drafted_tokens"]
    _wait(lambda: _metric(url, "fsd_drafted_total") >= requested, 120, f"fsd_drafted_total >= {requested}")

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=180) == 0, log_path.read_text()[-4000:]


def _stream(url: str, body: dict[str, Any], tier: str, stop_after: int | None = None) -> list[dict[str, Any]]:
    """The JSON events of a streamed completion; ``stop_after``: close the connection after that many."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"x-slo-tier": tier},
                      timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if stop_after is not None and len(events) >= stop_after:
                break
    return events


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)
