"""``model.engine: vllm`` on the project's side (no vLLM needed): config validation, the replica deployment's
options (the vLLM environment's interpreter through Ray's ``runtime_env.py_executable``), and the HF
directories the driver prepares for vLLM. The replica itself runs in ``tests/vllm/test_vllm_serve_e2e.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from controller.app import replica_options
from controller.config import FSDConfig, parse_config
from controller.vllm_replica import VLLM_PYTHON_ENV, prepare_vllm_config, vllm_python


def test_engine_defaults_to_native_and_accepts_vllm() -> None:
    assert FSDConfig().model.engine == "native"
    assert parse_config({"model": {"engine": "vllm"}}).model.engine == "vllm"


@pytest.mark.parametrize("bad", ["tensorrt", "VLLM", "", 1, None])
def test_unknown_engine_is_refused_naming_the_value(bad: object) -> None:
    with pytest.raises(ValueError) as err:
        parse_config({"model": {"engine": bad}})
    message = str(err.value)
    assert "model.engine" in message and repr(bad) in message and "'native'" in message


def test_vllm_engine_needs_an_hf_directory_for_pairs_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pair 'tiny'.*vllm\.target_dir"):
        parse_config({"model": {"engine": "vllm", "pair": "tiny"}})
    cfg = parse_config({"model": {"engine": "vllm", "pair": "my-model"}, "vllm": {"target_dir": str(tmp_path)}})
    assert cfg.vllm.target_dir == str(tmp_path.absolute())
    # The native engine ignores the vllm section: any pair goes.
    assert parse_config({"model": {"pair": "tiny"}}).model.engine == "native"


@pytest.mark.parametrize(("section", "needle"), [
    ({"kv_cache_gib": 1.5}, "vllm.kv_cache_gib"),  # vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer
    ({"kv_cache_gib": 0}, "vllm.kv_cache_gib"),
    ({"memory_fraction": 1.5}, "vllm.memory_fraction"),
    ({"draft_layers": 0}, "vllm.draft_layers"),
    ({"max_model_len": 4}, "vllm.max_model_len"),
    ({"pyhton": "/usr/bin/python3"}, "vllm.pyhton"),
])
def test_bad_vllm_options_name_the_field(section: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        parse_config({"model": {"engine": "vllm"}, "vllm": section})


def test_vllm_replicas_run_in_the_vllm_interpreter_with_an_in_process_engine_core() -> None:
    cfg = parse_config({"model": {"engine": "vllm", "div": "tv", "rule": "pure"},
                        "vllm": {"python": sys.executable, "kv_cache_gib": 2},
                        "serve": {"replica_num_cpus": 0.5}})
    actor = replica_options(cfg)["ray_actor_options"]
    assert actor["num_cpus"] == 0.5
    runtime_env = actor["runtime_env"]
    assert runtime_env["py_executable"] == sys.executable
    env = runtime_env["env_vars"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the plugin's counters are read in-process
    assert (env["FSD_VLLM_DIV"], env["FSD_VLLM_RULE"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("tv", "pure", "2")
    assert (Path(env["PYTHONPATH"]) / "controller" / "vllm_replica.py").is_file()
    # The native engine's replicas keep the driver's interpreter.
    assert "runtime_env" not in replica_options(FSDConfig())["ray_actor_options"]


def test_a_missing_vllm_environment_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(ValueError, match=r"no vLLM environment at .*no-venv.*make vllm-env"):
        vllm_python(parse_config({"model": {"engine": "vllm"}, "vllm": {"python": str(missing)}}))
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    assert vllm_python(parse_config({"model": {"engine": "vllm"}})) == sys.executable


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test pair's target (2 layers) saved as an HF directory, as vLLM loads models."""
    from decoder.models import tiny_pair

    pair = tiny_pair(seed=0)
    out = tmp_path_factory.mktemp("tiny-hf")
    pair.target.save_pretrained(out)
    pair.tokenizer.save_pretrained(out)
    return out


def test_prepare_resolves_the_target_and_writes_a_layer_truncated_draft(tiny_hf_dir: Path) -> None:
    cfg = parse_config({"model": {"engine": "vllm", "pair": "tiny-hf", "num_draft_tokens": 3},
                        "vllm": {"target_dir": str(tiny_hf_dir), "draft_layers": 1}})
    prepared = prepare_vllm_config(cfg)
    assert prepared.vllm.target_dir == str(tiny_hf_dir)
    assert prepared.vllm.draft_dir is not None
    draft = Path(prepared.vllm.draft_dir)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert (draft / "model.safetensors").is_file() and (draft / "tokenizer.json").is_file()
    # Everything else is unchanged, and the native engine's configs pass through untouched.
    assert prepared.model == cfg.model and prepared.slo == cfg.slo
    native = parse_config({"model": {"pair": "tiny"}})
    assert prepare_vllm_config(native) is native


def test_prepare_refuses_what_vllm_could_not_load(tiny_hf_dir: Path, tmp_path: Path) -> None:
    def prepare(**vllm: object) -> FSDConfig:
        return prepare_vllm_config(parse_config({"model": {"engine": "vllm", "pair": "x"}, "vllm": vllm}))

    with pytest.raises(ValueError, match=r"vllm\.draft_layers: .*\[1, 1\].*got 2"):
        prepare(target_dir=str(tiny_hf_dir), draft_layers=2)  # the tiny target has 2 layers: nothing to drop
    with pytest.raises(ValueError, match=r"vllm\.target_dir .*no config\.json"):
        prepare(target_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"vllm\.draft_dir .*no config\.json"):
        prepare(target_dir=str(tiny_hf_dir), draft_dir=str(tmp_path))
