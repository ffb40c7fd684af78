"""graft.atomic: a reader sees the old state or the new one, never a partial one, and nothing is left behind."""

import ctypes
import errno
import os
import stat
from pathlib import Path

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
    _save(target, "new")
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


# A writer that SIGKILLs itself just before or after the nth call of one step of `atomic_dir`: a
# process killed at that instant, with no finally block or exit handler run.
_KILLED_WRITER = """
import os, signal, sys
from graft import atomic

target, point, when, fallback = sys.argv[1:]
if fallback == "fallback":
    atomic._renameat2 = None
name, nth = point.split("#")
owner, attr = (os, name[3:]) if name.startswith("os.") else (atomic, name)
real, calls = getattr(owner, attr), []

def step(*args, **kwargs):
    calls.append(name)
    if len(calls) == int(nth) and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = real(*args, **kwargs)
    if len(calls) == int(nth) and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return result

setattr(owner, attr, step)
with atomic.atomic_dir(target, overwrite=True) as tmp:
    (tmp / "weights").write_text("new")
    (tmp / "new-only").write_text("new")
sys.exit(3)  # the kill point was never reached
"""
OLD = {"old-only": "old", "weights": "old"}
NEW = {"new-only": "new", "weights": "new"}


def _contents(path) -> dict[str, str] | None:
    return {p.name: p.read_text() for p in path.iterdir()} if path.exists() else None


def _killed_overwrite(tmp_path, point: str, when: str, fallback: str):
    """Run `_KILLED_WRITER` over an `adapter` holding OLD; what it left: (target's contents, entries)."""
    import subprocess
    import sys

    target = tmp_path / "adapter"
    target.mkdir()
    for name, text in OLD.items():
        (target / name).write_text(text)
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(target), point, when, fallback],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -9, f"the writer was not killed at {point} {when}: {child.stderr}"
    return _contents(target), _entries(tmp_path)


# Every step of an exchanging overwrite, and what a writer killed there leaves at the target;
# os.unlink#1 is mid-way through removing the exchanged-out old contents.
EXCHANGE_KILLS = [("fsync_tree#1", "before", OLD), ("fsync_tree#1", "after", OLD), ("_exchange#1", "before", OLD),
                  ("_exchange#1", "after", NEW), ("fsync_dir#2", "before", NEW), ("fsync_dir#2", "after", NEW),
                  ("_remove#1", "before", NEW), ("os.unlink#1", "after", NEW), ("_remove#1", "after", NEW)]


@pytest.mark.parametrize(("point", "when", "left_at_target"), EXCHANGE_KILLS)
def test_atomic_dir_killed_at_any_step_of_an_overwrite_leaves_old_or_new_never_neither(tmp_path, point, when,
                                                                                      left_at_target):
    left, entries = _killed_overwrite(tmp_path, point, when, "exchange")
    assert left == left_at_target
    temporaries = [name for name in entries if name != "adapter"]
    assert all(name.startswith(".adapter.tmp-") for name in temporaries)
    assert len(temporaries) == (0 if (point, when) == ("_remove#1", "after") else 1)
    assert atomic.sweep_temporaries(tmp_path) == [tmp_path / name for name in temporaries]
    assert _entries(tmp_path) == ["adapter"] and _contents(tmp_path / "adapter") == left


# The fallback's steps: os.replace#1 moves the old aside, os.replace#2 moves the new in, os.unlink#1
# is mid-way through removing the old.
@pytest.mark.parametrize(("point", "when", "left_before_sweep"),
                         [("os.replace#1", "before", OLD), ("os.replace#1", "after", None),
                          ("os.replace#2", "before", None), ("os.replace#2", "after", NEW),
                          ("os.unlink#1", "after", NEW)])
def test_atomic_dir_fallback_killed_between_its_renames_is_put_back_by_the_sweep(tmp_path, point, when,
                                                                                 left_before_sweep):
    """Without an exchange there is an instant with nothing at the target; the sweep moves the old back."""
    left, entries = _killed_overwrite(tmp_path, point, when, "fallback")
    assert left == left_before_sweep
    swept = atomic.sweep_temporaries(tmp_path)
    assert [p.name for p in swept] == [e for e in entries if e != "adapter"] and swept
    assert _entries(tmp_path) == ["adapter"] and _contents(tmp_path / "adapter") == (left or OLD)


def _save(target, text: str) -> None:
    """`text` as `target`'s one file, written through `atomic_dir` (overwriting what is there)."""
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / "weights").write_text(text)


def _fake_renameat2(code: int):
    def renameat2(*args):
        ctypes.set_errno(code)
        return -1
    return renameat2


@pytest.mark.parametrize("renameat2", [_fake_renameat2(errno.EINVAL), _fake_renameat2(errno.ENOSYS), None],
                         ids=["filesystem-EINVAL", "kernel-ENOSYS", "no-libc-function"])
def test_atomic_dir_overwrites_by_two_renames_where_no_exchange_is_available(tmp_path, monkeypatch, renameat2):
    target = tmp_path / "adapter"
    _save(target, "old")
    monkeypatch.setattr(atomic, "_renameat2", renameat2)
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: renamed.append(Path(b).name) or real_replace(a, b))
    _save(target, "new")
    assert renamed == ["adapter", "adapter"]  # the old aside (into its .old- holder), then the new in
    assert _entries(tmp_path) == ["adapter"] and (target / "weights").read_text() == "new"


def test_atomic_dir_overwrite_exchanges_without_any_plain_rename(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    _save(target, "old")
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: pytest.fail("a plain rename, not an exchange"))
    _save(target, "new")
    assert _entries(tmp_path) == ["adapter"] and (target / "weights").read_text() == "new"


def test_atomic_dir_exchange_failing_otherwise_raises_and_keeps_the_old(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    _save(target, "old")
    monkeypatch.setattr(atomic, "_renameat2", _fake_renameat2(errno.EACCES))
    with pytest.raises(PermissionError, match="adapter"):
        _save(target, "new")
    assert _entries(tmp_path) == ["adapter"] and (target / "weights").read_text() == "old"


def test_atomic_dir_fallback_whose_second_rename_fails_puts_the_old_back(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    _save(target, "old")
    monkeypatch.setattr(atomic, "_renameat2", None)
    real_replace, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise OSError(errno.EIO, "I/O error")
        real_replace(a, b)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="I/O error"):
        _save(target, "new")
    assert _entries(tmp_path) == ["adapter"] and (target / "weights").read_text() == "old"


def test_sweep_temporaries_removes_only_graft_temporaries(tmp_path):
    import tempfile

    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "users" / "alice" / "state").mkdir(parents=True)
    (root / "users" / "alice" / "state" / "weights").write_text("kept")
    ours = [Path(tempfile.mkdtemp(prefix=".state.tmp-", dir=root / "users" / "alice")),
            Path(tempfile.mkdtemp(prefix=".state.old-", dir=root / "users" / "alice")),
            Path(tempfile.mkstemp(prefix=".config.json.tmp-", dir=root)[1]),
            root / ".link.tmp-abc_0123"]
    (ours[0] / ".inner.tmp-abcdefgh").mkdir()  # inside a temporary: gone with it, not listed
    (ours[1] / "state").mkdir()  # an exchanged-out old whose target is there: removed
    ours[3].symlink_to(outside)
    theirs = [".state.tmp-short", ".state.tmp-ABCDEFGH", "state.tmp-abcdefgh", ".tmp-abcdefgh",
              ".state.load-abcdef12", ".state.tmp-abcdefgh.json", ".state.bak-abcdefgh"]
    for name in theirs:
        (root / name).mkdir()
    assert atomic.sweep_temporaries(root) == sorted(ours)
    assert _entries(root) == sorted([*theirs, "users"]) and _entries(root / "users" / "alice") == ["state"]
    assert (root / "users" / "alice" / "state" / "weights").read_text() == "kept" and outside.is_dir()
    assert atomic.sweep_temporaries(root) == [] and atomic.sweep_temporaries(tmp_path / "missing") == []
