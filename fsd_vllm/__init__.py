"""FSD on vLLM: the acceptance rule in vLLM's rejection-sampler layout and the plugin that installs it.

``fsd_vllm.acceptance`` is pure torch (importable in the project's venv, where its tests run);
``fsd_vllm.plugin`` imports vLLM and is only used inside the vLLM environment (``make vllm-env``).
Nothing is imported here eagerly, so ``import fsd_vllm`` never pulls in vLLM.
"""
