"""The rollout workflow end to end on the tiny pair: record a short load, fetch the recording, replay it
in the simulator with two policies, shadow a policy (with its simulator estimate), promote it.

No timing assertions: the recording is checked against what the client sent and received (count, tiers,
max_tokens, token counts, exactly), the replay against the recording (arrivals and token counts, exactly).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from policies.registry import resolve_spec
from tests.controller.conftest import ADMIN_TOKEN, RayServe, deployed_app, tiny_config
from tests.controller.conftest import wait_until as _wait

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
APP = "fsd-rollout-test"
LIVE_POLICY = {"policy": "static", "thresholds": {"standard": 0.25, "economy": 1.0}, "guards": False}
SHADOW_POLICY = {"policy": "static", "thresholds": {"standard": 0.75, "economy": 3.0}, "guards": False}


@pytest.fixture(scope="module")
def rollout_service(ray_serve: RayServe, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The tiny service with recording on; yields (base URL, the config YAML it runs)."""
    tmp = tmp_path_factory.mktemp("rollout")
    data = tiny_config(control={"policy": LIVE_POLICY},
                       recording={"enabled": True, "path": str(tmp / "recording.csv"), "max_bytes": 1_000_000,
                                  "shadow_window_s": 600, "shadow_every_s": 0.5})
    data["serve"]["app_name"] = APP
    config_path = tmp / "fsd.yaml"
    config_path.write_text(yaml.safe_dump(data))
    with deployed_app(ray_serve, data, APP) as url:
        yield url, config_path


def _requests(n: int) -> list[dict[str, Any]]:
    """A mixed load: tiers (header, body, default), max_tokens, streaming and not, chat and completions."""
    out = []
    for i in range(n):
        body: dict[str, Any] = {"max_tokens": [6, 12, 20][i % 3], "seed": i, "ignore_eos": i % 2 == 0,
                                "stream": i % 4 == 1}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}  # usage rides on a final `choices: []` chunk
        tier = ["standard", "economy", "lossless", None][i % 4]
        if tier is not None:
            body["fsd"] = {"tier": tier}
        chat = i % 5 == 0
        if chat:
            body["messages"] = [{"role": "user", "content": f"request {i}: say something"}]
        else:
            body["prompt"] = "a prompt " * (1 + i % 7)
        out.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body, "tier": tier})
    return out


async def _send(url: str, reqs: list[dict[str, Any]], gap_s: float) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(i: int, req: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(i * gap_s)
            r = await client.post(req["path"], json=req["body"])
            assert r.status_code == 200, r.text
            if req["body"]["stream"]:
                events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
                usage = next(e["usage"] for e in events if e.get("usage"))
                fsd = next(e["fsd"] for e in events if e.get("fsd"))
            else:
                usage, fsd = r.json()["usage"], r.json()["fsd"]
            return {"usage": usage, "tier": fsd["tier"], "max_tokens": req["body"]["max_tokens"]}

        return list(await asyncio.gather(*(one(i, req) for i, req in enumerate(reqs))))


def test_record_replay_shadow_promote(rollout_service: tuple[str, Path], tmp_path: Path, capsys) -> None:
    from fsd_cli.main import main
    from sim.trace import read_azure_trace

    url, config_path = rollout_service
    n = 16
    answers = asyncio.run(_send(url, _requests(n), gap_s=0.15))

    # ---- 1. the recording: admin only, one row per request, exact counts, no text ----------------
    assert httpx.get(f"{url}/v1/fsd/recording", timeout=10).status_code == 401
    out = tmp_path / "rec.csv"
    rows_written = _wait(lambda: main(["trace", "fetch", "--url", url, "--out", str(out), "--token", ADMIN_TOKEN]) == 0
                         and len(read_azure_trace(out)) == n, 20, "every request's row in the recording")
    assert rows_written
    assert "prompt" not in out.read_text() and "say something" not in out.read_text()
    trace = read_azure_trace(out)
    assert trace.status is not None and set(trace.status) <= {"stop", "length"}
    assert trace.tier is not None and trace.max_tokens is not None
    recorded = Counter(zip(trace.tier, trace.max_tokens.tolist(), trace.prompt_tokens.tolist(),
                           trace.output_tokens.tolist(), strict=True))
    sent = Counter((a["tier"], a["max_tokens"], a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"])
                   for a in answers)
    assert recorded == sent
    assert np.all(np.diff(trace.arrival_s) >= 0) and trace.arrival_s[0] == 0.0

    # ---- 2. replay with two policies: same arrivals and token counts as the recording ---------------
    report_path = tmp_path / "replay.json"
    rc = main(["sim", "compare", "--trace", str(out), "--config", str(config_path),
               "--policies", "static:0,static:1.0", "--json", str(report_path), "--quiet"])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert [r["policy"] for r in report["rows"]] == ["live", "static:0", "static:1.0"]
    assert report["live_policy"] == LIVE_POLICY
    for name, run in report["runs"].items():
        assert run["summary"]["requests"] == n, name
        assert run["summary"]["tiers"].keys() == {"standard", "economy", "lossless"}
    # The per-request records of a replay (the CLI's, rebuilt here) are the recording's arrivals and tokens.
    from controller.config import load_config
    from controller.rollout import sim_inputs, sim_policy
    from sim.profile import Profile
    from sim.replay import replay, requests_from_trace

    inputs = sim_inputs(load_config(config_path))
    profile = Profile.default()
    requests = requests_from_trace(trace, inputs.slo)
    policies = {name: sim_policy(spec, inputs.slo, profile, inputs.config.k)
                for name, spec in (("live", inputs.live_policy), ("static:1.0", "static:1.0"))}
    result = replay(requests, inputs.slo, profile, inputs.config, policies)
    for run in result.runs:
        rec = run.result.records
        assert np.array_equal(rec["arrival_s"], trace.arrival_s), run.name
        assert np.array_equal(rec["prompt_tokens"], trace.prompt_tokens), run.name
        assert np.array_equal(rec["output_tokens"], trace.output_tokens), run.name
        assert [inputs.slo.default_tier if t is None else t for t in trace.tier] == \
            [requests.tier_names[i] for i in rec["tier"]]
        assert run.result.summary["output_tokens"] == int(trace.output_tokens.sum()), run.name
    assert report["rows"][0]["mean_distortion"] == pytest.approx(
        result.runs[0].result.summary["mean_distortion"])  # the CLI's replay is this replay (same seed)

    # ---- 3. shadow: what it would set and the simulator's estimate on the recorded window -----------
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.put("/v1/fsd/policy", params={"shadow": True}, json=SHADOW_POLICY, headers=AUTH)
        assert r.status_code == 200, r.text

        def estimate() -> dict[str, Any] | None:
            st = client.get("/v1/fsd/status", params={"history": 0}).json()
            est = st["shadow_estimate"]
            would = (est or {}).get("tiers", {}).get("standard", {}).get("shadow_would_set")
            return est if est and est.get("requests") == n and would == 0.75 else None

        est = _wait(estimate, 30, "the shadow estimate over the recorded window")
        assert set(est["tiers"]) == {"standard", "economy", "lossless"}
        std = est["tiers"]["standard"]
        assert std["live_threshold"] == 0.25
        assert std["shadow"]["sim_mean_threshold"] == pytest.approx(0.75)
        assert std["live"]["sim_mean_threshold"] == pytest.approx(0.25)
        for side in ("shadow", "live"):
            assert 0.0 <= std[side]["slo_attainment"] <= 1.0
            assert std[side]["distortion_budget"] == 0.15
        assert std["shadow"]["mean_distortion"] > std["live"]["mean_distortion"]  # higher T, more distortion
        assert est["tiers"]["lossless"]["shadow"]["mean_distortion"] == 0.0

        # ---- 4. promote: admin only, one call, validated, recorded in the history -------------------
        assert client.post("/v1/fsd/policy/promote").status_code == 401
        r = client.post("/v1/fsd/policy/promote", headers=AUTH)
        assert r.status_code == 200, r.text
        st = r.json()
        assert st["policy"]["spec"] == SHADOW_POLICY and st["shadow_policy"] is None
        event = st["history"][-1]["event"]
        assert event == {"kind": "promote", "policy": SHADOW_POLICY, "resolved_policy": resolve_spec(SHADOW_POLICY),
                         "previous_policy": LIVE_POLICY}
        _wait(lambda: client.get("/v1/fsd/status", params={"history": 0}).json()["thresholds"]["standard"] == 0.75,
              10, "the promoted policy to apply")
        history = client.get("/v1/fsd/status", params={"history": 10_000}).json()["history"]
        assert sum(1 for h in history if (h.get("event") or {}).get("kind") == "promote") == 1
        r = client.post("/v1/fsd/policy/promote", headers=AUTH)  # nothing left in shadow
        assert r.status_code == 400 and "no shadow policy" in r.json()["error"]["message"]
    capsys.readouterr()
