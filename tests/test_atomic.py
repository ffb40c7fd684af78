"""graft.atomic: a reader sees the old state or the new one, never a partial one, and nothing is left behind."""

import os
import stat

import pytest

from graft import atomic
from graft.atomic import atomic_dir, atomic_write_text, fsync_tree


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _entries(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_atomic_dir_publishes_the_filled_directory(tmp_path, umask_022):
    target = tmp_path / "out" / "adapter"  # missing parents are made
    with atomic_dir(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".adapter.tmp-")
        assert not target.exists()  # nothing visible while it is being filled
        (tmp / "weights").write_text("new")
    assert (target / "weights").read_text() == "new"
    assert _entries(tmp_path / "out") == ["adapter"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # readable by engines running as another user


def test_atomic_dir_writer_raises_leaves_no_target_and_no_temporary(tmp_path):
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_dir(tmp_path / "adapter") as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("writer died")
    assert _entries(tmp_path) == []


def test_atomic_dir_overwrite_replaces_the_whole_directory_or_nothing(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "old-only").write_text("old")
    (target / "weights").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target, overwrite=True) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("writer died")
    assert _entries(target) == ["old-only", "weights"] and (target / "weights").read_text() == "old"
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / "weights").write_text("new")
    assert _entries(target) == ["weights"] and (target / "weights").read_text() == "new"
    assert _entries(tmp_path) == ["adapter"]  # no .old- or .tmp- directory left


def test_atomic_dir_refuses_a_non_empty_target_without_overwrite(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    with atomic_dir(target) as tmp:  # an empty directory may be filled
        (tmp / "weights").write_text("first")
    with pytest.raises(ValueError, match="adapter already exists and is not empty"):
        with atomic_dir(target):
            pytest.fail("the body must not run")
    assert (target / "weights").read_text() == "first" and _entries(tmp_path) == ["adapter"]


def test_atomic_write_text_creates_and_replaces(tmp_path, umask_022):
    path = tmp_path / "sub" / "config.json"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two" and _entries(path.parent) == ["config.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600


def test_atomic_write_text_failure_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("old")

    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new, half written")
    assert path.read_text() == "old" and _entries(tmp_path) == ["config.json"]


def test_fsync_tree_syncs_every_file_and_directory(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("x", "a/y", "a/b/z"):
        (tmp_path / name).write_text(name)
    synced = []
    real_fsync = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", record)
    fsync_tree(tmp_path)
    expected = {tmp_path / p for p in ("x", "a/y", "a/b/z", ".", "a", "a/b")}
    assert {os.path.normpath(p) for p in synced} == {os.path.normpath(p) for p in expected}
