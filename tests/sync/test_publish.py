import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import graft.sync.publish as publish_mod
from graft.sync.publish import (
    CorruptVersionError,
    PublishError,
    WeightPublisher,
    read_version,
    version_dir_name,
)
from tests.sync.publish_worker import write_files

WORKER = Path(__file__).with_name("publish_worker.py")


def _writer(files: dict[str, bytes]):
    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)

    return write


def _small(version: int) -> dict[str, bytes]:
    return {"adapter_model.safetensors": bytes([version % 256]) * (1000 + version), "adapter_config.json": b"{}"}


def _hidden(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("."))


def _incomplete_dirs(root: Path) -> list[str]:
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and not p.with_name(p.name + ".ready").exists()
    )


def test_version_dir_name():
    assert version_dir_name("adapter", 7) == "adapter-v000007"
    assert version_dir_name("full", 1234567) == "full-v1234567"
    with pytest.raises(PublishError, match="unknown weight kind"):
        version_dir_name("lora", 1)


def test_round_trip_files_hashes_bytes_step(tmp_path):
    files = {
        "adapter_model.safetensors": os.urandom(300_000),
        "adapter_config.json": b'{"r": 8}',
        "sub/extra.bin": b"x" * 17,
    }
    pv = WeightPublisher(tmp_path).publish("adapter", 7, step=70, write=_writer(files))

    assert pv.kind == "adapter" and pv.version == 7 and pv.step == 70
    assert pv.path == tmp_path / "adapter-v000007"
    assert pv.bytes == sum(len(d) for d in files.values())
    assert sorted(pv.files) == sorted(files)
    for name, data in files.items():
        assert pv.files[name].sha256 == hashlib.sha256(data).hexdigest()
        assert pv.files[name].bytes == len(data)
        assert (pv.path / name).read_bytes() == data

    manifest = json.loads((tmp_path / "adapter-v000007.ready").read_text())
    assert manifest["kind"] == "adapter" and manifest["version"] == 7 and manifest["step"] == 70
    assert manifest["files"]["sub/extra.bin"] == {"sha256": hashlib.sha256(b"x" * 17).hexdigest(), "bytes": 17}
    assert read_version(tmp_path, "adapter", 7) == pv
    assert sorted(os.listdir(tmp_path)) == ["adapter-v000007", "adapter-v000007.ready"]


def test_versions_ascending_latest_and_kinds_independent(tmp_path):
    pub = WeightPublisher(tmp_path)
    assert pub.latest("adapter") is None and pub.versions("adapter") == []
    for v in (1, 3, 10, 12):
        pub.publish("adapter", v, step=v, write=_writer(_small(v)))
    pub.publish("merged", 2, step=2, write=_writer(_small(2)))

    assert [pv.version for pv in pub.versions("adapter")] == [1, 3, 10, 12]
    assert pub.latest("adapter").version == 12
    assert [pv.version for pv in pub.versions("merged")] == [2]
    assert pub.latest("full") is None
    with pytest.raises(PublishError, match="unknown weight kind"):
        pub.versions("lora")


def test_non_increasing_version_and_bad_input_rejected(tmp_path):
    pub = WeightPublisher(tmp_path)
    pub.publish("adapter", 5, step=5, write=_writer(_small(5)))
    for v in (5, 4):
        with pytest.raises(PublishError, match="not above the latest"):
            pub.publish("adapter", v, step=v, write=_writer(_small(v)))
    with pytest.raises(PublishError, match="unknown weight kind"):
        pub.publish("lora", 6, step=6, write=_writer(_small(6)))
    with pytest.raises(PublishError, match="no file"):
        pub.publish("adapter", 6, step=6, write=lambda tmp: (tmp / "empty_dir").mkdir())
    assert sorted(os.listdir(tmp_path)) == ["adapter-v000005", "adapter-v000005.ready"]
    kept = (tmp_path / "adapter-v000005" / "adapter_model.safetensors").read_bytes()
    assert kept == _small(5)["adapter_model.safetensors"]


def test_write_raising_leaves_no_trace(tmp_path):
    pub = WeightPublisher(tmp_path)

    def failing(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"partial" * 1000)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        pub.publish("adapter", 1, step=1, write=failing)
    assert os.listdir(tmp_path) == []
    assert pub.versions("adapter") == []
    pub.publish("adapter", 1, step=1, write=_writer(_small(1)))  # the version is still free


def test_dir_without_ready_is_invisible_and_replaced(tmp_path):
    pub = WeightPublisher(tmp_path)
    pub.publish("adapter", 1, step=1, write=_writer(_small(1)))
    # A crash after the rename and before .ready, plus a crashed temp dir of the same version.
    (tmp_path / "adapter-v000002").mkdir()
    (tmp_path / "adapter-v000002" / "stale.bin").write_bytes(b"old")
    (tmp_path / ".adapter-v000002.tmp-abc").mkdir()

    assert [pv.version for pv in pub.versions("adapter")] == [1]
    assert pub.latest("adapter").version == 1
    with pytest.raises(PublishError, match="not published") as excinfo:
        read_version(tmp_path, "adapter", 2)
    assert not isinstance(excinfo.value, CorruptVersionError)

    pv = pub.publish("adapter", 2, step=20, write=_writer(_small(2)))
    assert sorted(os.listdir(pv.path)) == sorted(_small(2))
    assert read_version(tmp_path, "adapter", 2).step == 20
    assert [v.version for v in WeightPublisher(tmp_path).versions("adapter")] == [1, 2]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_file_detected_and_named(tmp_path, damage):
    files = {"adapter_model.safetensors": os.urandom(50_000), "adapter_config.json": b"{}"}
    pv = WeightPublisher(tmp_path).publish("adapter", 3, step=3, write=_writer(files))
    target = pv.path / "adapter_model.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[:-1]))
    else:
        target.unlink()

    with pytest.raises(CorruptVersionError, match="adapter_model.safetensors"):
        read_version(tmp_path, "adapter", 3)
    if damage == "flip":  # same size: only the hash can tell
        assert read_version(tmp_path, "adapter", 3, verify_hashes=False).version == 3


def test_unparseable_manifest_is_corrupt_and_not_a_version(tmp_path):
    pub = WeightPublisher(tmp_path)
    pub.publish("adapter", 1, step=1, write=_writer(_small(1)))
    pub.publish("adapter", 2, step=2, write=_writer(_small(2)))
    (tmp_path / "adapter-v000002.ready").write_text("{not json")
    with pytest.raises(CorruptVersionError, match=r"adapter-v000002\.ready"):
        read_version(tmp_path, "adapter", 2)
    assert [pv.version for pv in pub.versions("adapter")] == [1]
    assert pub.latest("adapter").version == 1
    pub.publish("adapter", 2, step=2, write=_writer(_small(2)))  # replaces dir and manifest
    assert read_version(tmp_path, "adapter", 2).version == 2


def test_gc_keeps_newest_and_protected_and_removes_ready_before_dir(tmp_path, monkeypatch):
    WeightPublisher(tmp_path)
    for v in range(1, 7):
        WeightPublisher(tmp_path).publish("adapter", v, step=v, write=_writer(_small(v)))
    WeightPublisher(tmp_path).publish("merged", 1, step=1, write=_writer(_small(1)))

    removed_dirs = []
    real_rmtree = publish_mod.shutil.rmtree

    def rmtree_checking_order(path, *args, **kwargs):
        path = Path(path)
        assert not path.with_name(path.name + ".ready").exists(), f"{path} removed while its .ready exists"
        removed_dirs.append(path.name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(publish_mod.shutil, "rmtree", rmtree_checking_order)
    pub = WeightPublisher(tmp_path, keep_versions=2)
    assert pub.garbage_collect("adapter", protect={1, 3}) == [2, 4]
    assert sorted(removed_dirs) == ["adapter-v000002", "adapter-v000004"]
    assert [pv.version for pv in pub.versions("adapter")] == [1, 3, 5, 6]
    assert not (tmp_path / "adapter-v000002").exists() and not (tmp_path / "adapter-v000004").exists()
    assert [pv.version for pv in pub.versions("merged")] == [1]
    assert WeightPublisher(tmp_path).garbage_collect("adapter") == []  # keep_versions=0 keeps all

    # publish() collects automatically, without protection.
    pub.publish("adapter", 7, step=7, write=_writer(_small(7)))
    assert [pv.version for pv in pub.versions("adapter")] == [6, 7]
    assert sorted(removed_dirs) == [f"adapter-v00000{v}" for v in (1, 2, 3, 4, 5)]


def test_gc_removes_crash_leftovers_older_than_newest(tmp_path):
    pub = WeightPublisher(tmp_path, keep_versions=5)
    pub.publish("adapter", 4, step=4, write=_writer(_small(4)))
    leftovers = [".adapter-v000005.tmp-a1", ".adapter-v000003.old-b2", "adapter-v000002"]
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.bin").write_bytes(b"junk")
    (tmp_path / ".adapter-v000005.ready.tmp-c3").write_text("{")
    (tmp_path / "adapter-v000003.ready").write_text("garbage")
    kept = ["adapter-v000009", ".adapter-v000009.tmp-d4", ".merged-v000001.tmp-e5", "merged-v000002"]
    for name in kept:
        (tmp_path / name).mkdir()

    pub.publish("adapter", 5, step=5, write=_writer(_small(5)))
    assert sorted(os.listdir(tmp_path)) == sorted(
        kept + ["adapter-v000004", "adapter-v000004.ready", "adapter-v000005", "adapter-v000005.ready"]
    )


def test_load_paths_name_the_weights_and_go_with_their_versions(tmp_path):
    """A version published again with other weights (a resumed run) loads through another path, the
    same weights through the same one; links leave with their versions (retention and discard)."""
    pub = WeightPublisher(tmp_path, keep_versions=2)
    first = pub.load_path(pub.publish("adapter", 1, 1, _writer(_small(1))))
    assert first.parent == tmp_path and first.resolve() == tmp_path / "adapter-v000001"
    assert json.loads((first / "adapter_config.json").read_text()) == {}
    assert pub.discard_from("adapter", 1) == [1] and _hidden(tmp_path) == []
    again = pub.publish("adapter", 1, 1, _writer(_small(7)))  # version 1 again, other bytes
    other = pub.load_path(again)
    assert other != first and other.resolve() == again.path and pub.load_path(again) == other
    for v in (2, 3):
        pub.load_path(pub.publish("adapter", v, v, _writer(_small(v))))
    assert [link.resolve().name for link in map(tmp_path.joinpath, _hidden(tmp_path))] == \
        ["adapter-v000002", "adapter-v000003"]  # version 1's link went with it


def test_new_publisher_on_same_root_sees_versions_and_continues(tmp_path):
    first = WeightPublisher(tmp_path, keep_versions=3)
    published = [first.publish("adapter", v, step=10 * v, write=_writer(_small(v))) for v in range(1, 5)]
    second = WeightPublisher(str(tmp_path), keep_versions=3)
    assert second.versions("adapter") == published[-3:]
    assert second.latest("adapter") == published[-1]
    with pytest.raises(PublishError):
        second.publish("adapter", 4, step=40, write=_writer(_small(4)))
    second.publish("adapter", 5, step=50, write=_writer(_small(5)))
    assert [pv.version for pv in first.versions("adapter")] == [3, 4, 5]


def _start_worker(root: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(WORKER), str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    return proc


def test_sigkill_at_random_moments_never_exposes_a_partial_version(tmp_path):
    """SIGKILL a publishing process at random instants: every visible version always verifies, the
    latest never goes back, and a new publisher continues from the last complete version."""
    rng = random.Random(0)
    trials, previous_latest = 40, 0
    stats = {"worker_published": 0, "temp_left": 0, "incomplete_dir_left": 0, "same_version_replaced": 0}
    t0 = time.monotonic()
    for _ in range(trials):
        proc = _start_worker(tmp_path)
        try:
            time.sleep(rng.uniform(0.0, 0.150))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stats["worker_published"] += sum(1 for line in proc.stdout if line.startswith("published"))
        proc.stdout.close()
        stats["temp_left"] += bool(_hidden(tmp_path))
        incomplete = _incomplete_dirs(tmp_path)
        stats["incomplete_dir_left"] += bool(incomplete)

        pub = WeightPublisher(tmp_path, keep_versions=3)
        visible = pub.versions("adapter")
        for pv in visible:
            assert read_version(tmp_path, "adapter", pv.version, verify_hashes=True) == pv
        latest = visible[-1].version if visible else 0
        assert latest >= previous_latest

        nxt = latest + 1
        stats["same_version_replaced"] += version_dir_name("adapter", nxt) in incomplete
        pv = pub.publish("adapter", nxt, step=10 * nxt, write=lambda tmp, v=nxt: write_files(tmp, v))
        assert read_version(tmp_path, "adapter", nxt) == pv
        assert [v.version for v in pub.versions("adapter")][-1] == nxt
        assert len(pub.versions("adapter")) <= 3
        assert _hidden(tmp_path) == [] and _incomplete_dirs(tmp_path) == []
        previous_latest = nxt

    print(f"\nkill trials: {trials} in {time.monotonic() - t0:.1f} s, {stats}")
    assert stats["worker_published"] > 0, "no kill landed after a complete publish"
    assert stats["temp_left"] > 0, "no kill landed in the middle of a write"
