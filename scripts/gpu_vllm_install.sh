#!/bin/sh
# On a GPU box, in the repository root: take in the carried parts of .gpu-vllm/ (scripts/gpu_vllm_wheels.py)
# and, once every part of manifest.json has arrived over this and earlier calls on the same warm machine,
# install the wheels into /tmp/gpu-vllm/site (no dependencies resolved there: each one is carried).
# Prints the site directory when it is ready, else how many parts are still to come.
set -eu
dir=/tmp/gpu-vllm
mkdir -p "$dir/parts"
for part in .gpu-vllm/part-*; do [ -e "$part" ] && cp "$part" "$dir/parts/"; done
need=$(python3 -c "import json; print(len(json.load(open('.gpu-vllm/manifest.json'))['parts']))")
have=$(ls "$dir/parts" | wc -l)
if [ "$have" -lt "$need" ]; then echo "gpu-vllm: $have of $need parts"; exit 0; fi
if [ ! -e "$dir/site/vllm/__init__.py" ]; then
  mkdir -p "$dir/wheels"
  cat "$dir"/parts/part-* | tar -x -C "$dir/wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dir/site" "$dir"/wheels/*.whl
fi
echo "gpu-vllm: ready in $dir/site"
