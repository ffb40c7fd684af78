"""CUDA vLLM for a GPU box without internet, in parts small enough to carry one per call.

The GPU boxes here bring torch 2.11 (CUDA 13), transformers, numpy and much else, but no vLLM, and a
call carries at most 64 MiB. vLLM 0.20.2 is the release built against torch 2.11.0 and libcudart 13
(checked: its `_C.abi3.so` needs `libcudart.so.13`); its wheel is 244 MB. This fetches it and every
requirement the box's image lacks (resolved here, recursively: the box installs with `--no-deps`),
then packs them into one tar split into `PART_MIB` parts:

    python3 scripts/gpu_vllm_wheels.py            # -> .gpu-vllm/part-00 ... part-NN, .gpu-vllm/manifest.json

On the box, one call per part, back to back (a machine stays warm 30 s between calls and keeps /tmp),
each with `carry: [".gpu-vllm/part-KK"]`: `sh scripts/gpu_vllm_install.sh` appends the part to
/tmp/gpu-vllm and, after the last, installs everything into /tmp/gpu-vllm/site. Checked without a GPU
by doing the same with a Python 3.12 holding the box's torch 2.11.0, transformers 5.17.0 and numpy
2.5.2, then `scripts/gpu_vllm_smoke.py /tmp/gpu-vllm/site` (which `make gpu-check` runs first on the box).

Left out on purpose (`LEFT_OUT`): torch and its CUDA libraries (the box's own), flashinfer and the
CUTLASS/cuDNN Python kernels (optional in vLLM: on Hopper its default attention is the FlashAttention
bundled in the wheel; without flashinfer its sampler uses PyTorch's), tilelang.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

VLLM = "vllm==0.20.2"
PART_MIB = 58  # + the ~3 MiB working tree: under a call's 64 MiB
MAX_BACKTRACK = 20  # older versions tried per package before giving up
# The GPU image's packages (/work/.library/device/KINDS.md, read 2026-11-17), normalized names.
ON_THE_BOX = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject- hooks pyre-extensions pytest python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# Not carried: the box's own torch stack; kernels vLLM imports only where it uses them (flashinfer,
# quack; tilelang and its z3-solver, 75 MB: only DeepSeek-V4's mHC layer, vllm/model_executor/layers/mhc.py).
LEFT_OUT = re.compile(r"^(nvidia-.*|flashinfer-.*|quack-kernels|torch.*|triton|tilelang|z3-solver)$")
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "linux_x86_64"]
# The box's interpreter: Python 3.12 on x86-64 Linux.
BOX = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(requirement: str, into: Path) -> Path:
    """One wheel (no dependencies) for the box's Python and platform; returns its path."""
    before = set(into.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(into), requirement]
    subprocess.run(command, check=True)
    new = set(into.glob("*.whl")) - before
    name = normalized(Requirement(requirement).name)
    return next(iter(new)) if new else next(p for p in into.glob("*.whl") if normalized(p.name.split("-")[0]) == name)


def requirements_of(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's own requirements that apply on the box: markers evaluated without an extra and with
    each of `extras` ("" = the wheel's plain requirements)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    environments = [{**BOX, "extra": extra} for extra in extras]
    return [r for r in found if r.marker is None or any(r.marker.evaluate(env) for env in environments)]


def version_of(wheel: Path) -> Version:
    return Version(wheel.name.split("-")[1])


def clashes(wheel: Path, asked: dict[str, SpecifierSet], chosen: dict[str, Path]) -> list[str]:
    """The wheel's requirements that an exact pin asked elsewhere, or a wheel already chosen, cannot meet."""
    found = []
    for requirement in requirements_of(wheel, {""}):
        name = normalized(requirement.name)
        pinned = [Version(spec.version) for spec in asked.get(name, ()) if spec.operator == "=="]
        if name in chosen:
            pinned.append(version_of(chosen[name]))
        found += [f"{wheel.name} needs {requirement} (have {version})" for version in pinned
                  if not requirement.specifier.contains(version, prereleases=True)]
    return found


def download_compatible(name: str, asked: dict[str, SpecifierSet], chosen: dict[str, Path], into: Path) -> Path:
    """The newest wheel of `name` within what was asked of it whose own requirements fit the exact pins
    asked so far: vLLM 0.20.2 pins apache-tvm-ffi==0.1.9, which xgrammar 0.2.7+ (within vLLM's own
    range for it) cannot use, so an older xgrammar is taken (pip's resolver backtracks the same way)."""
    specifier = asked[name]
    for _ in range(MAX_BACKTRACK):
        wheel = download(f"{name}{specifier}", into)
        if not clashes(wheel, asked, chosen):
            return wheel
        wheel.unlink()
        specifier &= SpecifierSet(f"<{version_of(wheel)}")
    raise SystemExit(f"no wheel of {name} within {asked[name]} fits: {clashes(wheel, asked, chosen)}")


def resolve(into: Path) -> list[Path]:
    """vLLM and, recursively, each requirement neither on the box nor left out, with the extras it is
    asked for (mistral-common needs `pydantic-extra-types[pycountry]`: without pycountry, importing
    vLLM's API server failed): one wheel per name, within everything asked of that name."""
    chosen: dict[str, Path] = {}
    extras_done: dict[str, set[str]] = {}
    asked: dict[str, SpecifierSet] = {normalized(Requirement(VLLM).name): Requirement(VLLM).specifier}
    queue = [Requirement(VLLM)]
    while queue:
        requirement = queue.pop(0)
        name = normalized(requirement.name)
        if name in ON_THE_BOX or LEFT_OUT.match(name):
            continue
        extras = {""} | {normalized(extra) for extra in requirement.extras}
        extras -= extras_done.setdefault(name, set())
        if not extras:
            continue
        if name not in chosen:
            chosen[name] = download_compatible(name, asked, chosen, into)
        extras_done[name] |= extras
        for needed in requirements_of(chosen[name], extras):
            key = normalized(needed.name)
            asked[key] = asked.get(key, SpecifierSet()) & needed.specifier
            queue.append(needed)
    unmet = [clash for wheel in chosen.values() for clash in clashes(wheel, {}, chosen)]
    if unmet:
        raise SystemExit("carried wheels that do not fit each other: " + "; ".join(unmet))
    return list(chosen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".gpu-vllm"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = resolve(Path(tmp))
        archive = Path(tmp) / "wheels.tar"
        subprocess.run(["tar", "-cf", str(archive), "-C", tmp, *(w.name for w in wheels)], check=True)
        for old in args.out.glob("part-*"):
            old.unlink()
        subprocess.run(["split", "-b", f"{PART_MIB}M", "-d", str(archive), str(args.out / "part-")], check=True)
    parts = sorted(p.name for p in args.out.glob("part-*"))
    manifest = {"vllm": VLLM, "wheels": sorted(w.name for w in wheels), "parts": parts}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(wheels)} wheels in {len(parts)} parts of at most {PART_MIB} MiB under {args.out}/")


if __name__ == "__main__":
    main()
