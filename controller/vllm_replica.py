"""``engine: vllm`` replicas: the native replica's control plane around vLLM's engine.

:class:`VLLMReplica` is :class:`controller.replica.FSDReplica` with another engine: the same batching
thread, request path, control channel (reports pushed to the controller, :class:`ThresholdPush` applied
from its replies — never a request slot), fail-safe, health check and ``fsd`` response object. Only
:meth:`~VLLMReplica._load_engine` (a :class:`fsd_vllm.engine.VLLMStepEngine` and its tokenizer) and
:meth:`~VLLMReplica._sampling_params` differ. Two things vLLM cannot do, said in ``docs/vllm.md``:

* **T applies at admission.** The controller's T per tier reaches every request admitted after the push
  (``SamplingParams.extra_args``, read by the fsd_vllm plugin); a running request keeps the T it started
  with (the native engine moves running requests too).
* **k is engine-wide** (``model.num_draft_tokens``). A pushed k per tier is ignored (logged once) and the
  replica reports the k it runs.

The replica process runs in the vLLM environment's interpreter (``make vllm-env``: vLLM caps transformers
below what ``decoder/`` needs), started by Ray with ``runtime_env.py_executable``
(:func:`replica_actor_options`). This module therefore imports nothing of ``decoder/`` at module level;
the driver-side helpers here (:func:`prepare_vllm_config`, :func:`vllm_python`) run in the project's venv.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller import protocol
from controller.batching import StepEngine
from controller.config import FSDConfig
from controller.replica import FSDReplica

logger = logging.getLogger("ray.serve")

#: Environment variable naming the vLLM environment's interpreter (overrides the checkout's .venv-vllm).
VLLM_PYTHON_ENV = "FSD_VLLM_PYTHON"
#: The source checkout (``controller/..``): where ``make vllm-env`` builds ``.venv-vllm``.
CHECKOUT = Path(__file__).resolve().parents[1]


class VLLMReplica(FSDReplica):
    """See the module docstring."""

    _engine: Any  # fsd_vllm.engine.VLLMStepEngine (vLLM is only importable in the replica's process)

    def _load_engine(self) -> tuple[Any, StepEngine]:
        from fsd_vllm.acceptance import DIVERGENCES, RULES
        from fsd_vllm.engine import VLLMEngineOptions, VLLMPair, VLLMStepEngine

        cfg = self._cfg
        if cfg.vllm.target_dir is None:
            raise ValueError("vllm.target_dir is not set: build the app with controller.app.build_app, which "
                             "resolves the pair's HF directories (prepare_vllm_config)")
        if cfg.model.div not in DIVERGENCES:
            raise ValueError(f"model.div {cfg.model.div!r} is not a divergence of the vLLM plugin: {DIVERGENCES}")
        if cfg.model.rule not in RULES:
            raise ValueError(f"model.rule {cfg.model.rule!r} is not a rule of the vLLM plugin: {RULES}")
        # The plugin reads its engine-wide settings from the environment when it registers (below, first).
        os.environ["FSD_VLLM_DIV"] = cfg.model.div
        os.environ["FSD_VLLM_RULE"] = cfg.model.rule
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm.kv_cache_gib))
        engine = VLLMStepEngine(VLLMEngineOptions(
            target_dir=cfg.vllm.target_dir,
            draft_dir=cfg.vllm.draft_dir,
            num_speculative_tokens=cfg.model.num_draft_tokens,
            max_num_seqs=cfg.model.max_batch_size,
            max_model_len=cfg.vllm.max_model_len,
            memory_fraction=cfg.vllm.memory_fraction,
            enforce_eager=cfg.vllm.enforce_eager,
            seed=cfg.model.seed,
        ))
        pair = VLLMPair.load(cfg.model.pair, cfg.vllm.target_dir, cfg.vllm.draft_dir, engine.max_model_len)
        self._k_warned = False
        return pair, engine

    def _sampling_params(self, req: protocol.GenerationRequest, tier: str) -> Any:
        from fsd_vllm.engine import VLLMRequestParams

        params = VLLMRequestParams(
            tier=tier,
            max_new_tokens=self._max_tokens(req),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=tuple(req.stop),
            ignore_eos=req.ignore_eos,
            seed=req.seed,
        )
        try:
            self._engine.check_params(params)
        except ValueError as exc:
            raise protocol.RequestError(422, str(exc), None) from None
        return params

    def _set_draft_lengths(self, draft_lengths: Mapping[str, int]) -> None:
        """k is vLLM's engine-wide ``num_speculative_tokens``: a different k per tier cannot be applied."""
        wanted = {name: int(k) for name, k in draft_lengths.items()
                  if name in self._slo.tiers and int(k) != self._draft_length}
        if wanted and not getattr(self, "_k_warned", False):
            self._k_warned = True
            logger.warning("FSD replica %s (vLLM): k per tier %s ignored; vLLM runs k=%d for every request",
                           self._replica_id, wanted, self._draft_length)

    def stats(self, drain: bool = False) -> dict[str, Any]:
        snap = super().stats(drain)
        snap["engine"] = "vllm"
        snap["vllm"] = {
            "target_dir": self._cfg.vllm.target_dir,
            "draft_dir": self._cfg.vllm.draft_dir,
            "threshold_applies": "at admission",
            "spec_decode": dataclasses.asdict(self._engine.spec_decode_totals()),
        }
        return snap


# ---- driver side (the project's venv): what the replica deployment needs ---------------------------------


def vllm_python(cfg: FSDConfig) -> str:
    """The vLLM environment's interpreter: ``vllm.python``, else ``$FSD_VLLM_PYTHON``, else the checkout's
    ``.venv-vllm``. ValueError when it is not there."""
    python = cfg.vllm.python or os.environ.get(VLLM_PYTHON_ENV) or str(CHECKOUT / ".venv-vllm" / "bin" / "python")
    if not os.access(python, os.X_OK):
        raise ValueError(
            f"model.engine 'vllm': no vLLM environment at {python} (build it with `make vllm-env`, or set "
            f"vllm.python / ${VLLM_PYTHON_ENV})"
        )
    return python


def prepare_vllm_config(cfg: FSDConfig) -> FSDConfig:
    """``cfg`` with ``vllm.target_dir`` / ``vllm.draft_dir`` filled in (the replica needs HF directories).

    The default pair's target is the native loader's dequantized SmolLM2 (converted here on first use);
    its draft, unless ``vllm.draft_dir`` names one, is a copy of the target's first ``vllm.draft_layers``
    layers (the native int8-dynamic draft is not loadable by vLLM). Runs in the project's venv.
    """
    if cfg.model.engine != "vllm":
        return cfg
    target = Path(cfg.vllm.target_dir) if cfg.vllm.target_dir is not None else _converted_target(cfg.model.pair)
    if not (target / "config.json").is_file():
        raise ValueError(f"vllm.target_dir {str(target)!r} is not an HF model directory (no config.json)")
    draft = cfg.vllm.draft_dir
    if draft is None and cfg.model.num_draft_tokens > 0:
        from fsd_vllm.offline import truncated_draft

        try:
            draft = str(truncated_draft(target, cfg.vllm.draft_layers))
        except ValueError as exc:
            raise ValueError(f"vllm.draft_layers: {exc}") from None
    elif draft is not None and not (Path(draft) / "config.json").is_file():
        raise ValueError(f"vllm.draft_dir {draft!r} is not an HF model directory (no config.json)")
    vllm = cfg.vllm.model_copy(update={"target_dir": str(target), "draft_dir": draft})
    return cfg.model_copy(update={"vllm": vllm})


def _converted_target(pair: str) -> Path:
    """The dequantized HF directory of a shipped pair's target, converting it on first use."""
    import torch

    from decoder import model_fetch

    if pair != "smollm2-135m":  # FSDConfig refuses other pairs without vllm.target_dir
        raise ValueError(f"model.engine 'vllm': no HF directory known for pair {pair!r}; set vllm.target_dir")
    out_dir = model_fetch.converted_dir(pair, "target")
    if not model_fetch.is_converted(out_dir):
        model_fetch.load_smollm2(pair, torch.float32)  # converts the packaged GGUF once, under a lock
    return out_dir


def replica_actor_options(cfg: FSDConfig) -> dict[str, Any]:
    """``ray_actor_options`` of a vLLM replica: its interpreter, and the environment vLLM reads at import."""
    env_vars = {
        # The plugin's counters are read in the replica's process: the engine core must run there.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm.kv_cache_gib),
        "FSD_VLLM_DIV": cfg.model.div,
        "FSD_VLLM_RULE": cfg.model.rule,
        # The project's packages (controller, policies, fsd_common) from this checkout; fsd_vllm and vLLM
        # are the vLLM environment's own. decoder/ is on the path too but never imported there.
        "PYTHONPATH": str(CHECKOUT),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {
        "num_cpus": cfg.serve.replica_num_cpus,
        "runtime_env": {"py_executable": vllm_python(cfg), "env_vars": env_vars},
    }
