#!/usr/bin/env bash
# `make gpu-wheels`: the wheels a GPU box without internet lacks for `make gpu-check` (graft's own
# dependencies and the TRL side of its update bench), for its Python 3.12 on x86-64 Linux, into DIR
# (default .whl). Its image brings torch, transformers, peft, accelerate, pandas, pyarrow and the rest;
# `make gpu-check GPU_CHECK_ARGS="--wheels DIR"` then installs all of these beside it (no dependencies
# resolved there: each is named here). About 5 MB; PYARROW=1 adds pyarrow 26 (~45 MB), for an image
# whose pyarrow is older than datasets 5.2 needs (24).
set -euo pipefail
dir=${1:-.whl}
packages=(pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
          typing-extensions==4.16.0 gguf==0.19.0
          trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0)
if [ "${PYARROW:-0}" = 1 ]; then packages+=(pyarrow==26.0.1); fi
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" "${packages[@]}"
du -sh "$dir"
