"""Ray Serve's own deployment path: the shipped Serve config, the application builder, ``serve run``.

The shipped ``controller/configs/serve_config.yaml`` must be exactly what ``python -m controller.app``
generates from ``example.yaml`` (so the two never drift), must validate as Serve's own schema, and
``serve run`` of it (tiny pair, free port, a fresh local cluster in a subprocess) must serve a completion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controller.app import IMPORT_PATH, build_app, serve_config, serve_config_yaml
from controller.config import parse_config
from tests.controller.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "controller/configs/serve_config.yaml"
EXAMPLE = "controller/configs/example.yaml"


def shipped() -> dict[str, Any]:
    return yaml.safe_load((REPO / SHIPPED).read_text(encoding="utf-8"))


def test_shipped_serve_config_is_generated_from_the_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert (REPO / SHIPPED).read_text(encoding="utf-8") == serve_config_yaml(EXAMPLE), (
        f"regenerate: python -m controller.app {EXAMPLE} > {SHIPPED}")


def test_shipped_serve_config_is_a_valid_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(shipped())
    (application,) = schema.applications
    assert application.import_path == IMPORT_PATH
    cfg = parse_config(application.args)
    example = yaml.safe_load((REPO / EXAMPLE).read_text(encoding="utf-8"))
    assert cfg.model.pair == example["model"]["pair"]
    assert schema.http_options.port == example["http"]["port"]
    # What Serve's fields decide is not duplicated in args.
    assert "ray" not in application.args and "port" not in application.args.get("http", {})


def test_build_app_takes_the_config_mapping_as_serve_args() -> None:
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(build_app, shipped()["applications"][0]["args"])
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="model.bogus"):
        build_app({"model": {"bogus": 1}})


def test_serve_config_refuses_a_bad_fsd_config() -> None:
    with pytest.raises(ValueError, match="control.interval_s"):
        serve_config({"control": {"interval_s": -1}})


def _tiny_serve_config(port: int) -> dict[str, Any]:
    config = shipped()
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["model"].update(pair="tiny", max_batch_size=4)
    args["replica"].update(default_max_new_tokens=16, max_new_tokens_limit=400)
    args["serve"].update(replica_num_cpus=0.5)
    return config


@pytest.mark.ray
@pytest.mark.slow  # its own cluster in a subprocess: ~1-2 min
@pytest.mark.timeout(420)
def test_serve_run_of_the_shipped_config_serves_a_completion(tmp_path: Path) -> None:
    serve_cli = Path(sys.executable).parent / "serve"
    if not serve_cli.exists():
        pytest.skip("Ray Serve's CLI is not installed next to this Python")
    port = free_port()
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(_tiny_serve_config(port)), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log_path = tmp_path / "serve_run.log"
    with open(log_path, "wb") as log:
        # --address local: always a fresh cluster of its own, never one another test or user started.
        # SIGINT back to its default: a test run started in the background (`make test &`, nohup) hands its
        # children SIGINT ignored, and `serve run` would then sit out the 90 s wait below before a SIGKILL.
        proc = subprocess.Popen([str(serve_cli), "run", "--address", "local", str(config_path)], cwd=tmp_path,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"serve run exited early:\n{log_path.read_text(errors='replace')[-3000:]}"
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log_path.read_text(errors='replace')[-3000:]}"
            time.sleep(1.0)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 6}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and 1 <= body["usage"]["completion_tokens"] <= 6
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    finally:
        proc.send_signal(signal.SIGINT)  # serve run's own shutdown path: serve.shutdown(), then Ray's
        try:
            proc.wait(timeout=90)
            stopped = True
        except subprocess.TimeoutExpired:
            stopped = False
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    # Our deployment must not hold up Serve's own shutdown (a replica or controller that ignores its stop).
    assert stopped, f"serve run did not stop within 90 s of SIGINT:\n{log_path.read_text(errors='replace')[-3000:]}"
