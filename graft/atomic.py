"""Atomic file and directory writes: readers see the old state or the new one, never a partial one.

Everything graft publishes (adapters, merged models, configs, tenants' saved states) goes through
here, so that a crash or an exception at any instant leaves no half-written file behind at the target
path: a file or directory is filled under a hidden sibling name, fsynced, then renamed (a directory
that replaces another: exchanged) into place. What a killed process leaves is only those hidden
siblings, which `sweep_temporaries` removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

RENAME_EXCHANGE = 2  # <linux/fs.h>: renameat2() swaps the two names in one step
_AT_FDCWD = -100  # <fcntl.h>: relative paths are from the working directory
# The temporaries named here: ".<name>.tmp-" or ".<name>.old-" and tempfile's 8 random characters.
_TEMPORARY_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[a-z0-9_]{8}$")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then the directories, so a rename publishes durable data."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_empty_dir(out_dir: str | os.PathLike) -> Path:
    """`out_dir` as a Path, checked to be new or empty: a builder writes into it and must not mix its
    files with another's.

    Raises:
        ValueError: `out_dir` exists and is not empty.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} already exists and is not empty; refusing to overwrite it")
    return out_dir


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `target` to fill; on success fsync it and put it in place.

    An existing `target` is swapped with the new directory in one step (`renameat2(RENAME_EXCHANGE)`),
    so a process killed at any instant leaves the old directory or the new one at `target`, never
    neither and never a partial one; the old contents, then at the temporary path, are removed
    after. Where the exchange is unavailable, see `_replace_by_two_renames`. A killed writer leaves
    its hidden `.<name>.tmp-*` sibling behind for `sweep_temporaries`. On an exception the temporary
    directory is removed and `target` is left as it was.

    Raises:
        ValueError: `target` exists and is not empty, and `overwrite` is False.
    """
    target = Path(target)
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{target} already exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes 0700; published weights must be readable by engines running as another user.
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        fsync_tree(tmp)  # the contents are durable before any name points at them
        if not os.path.lexists(target):
            os.replace(tmp, target)
        elif not _exchange(tmp, target):
            _replace_by_two_renames(tmp, target)
        fsync_dir(target.parent)
    finally:
        if os.path.lexists(tmp):  # the abandoned new contents, or after an exchange the old ones
            _remove(tmp)


def _load_renameat2():
    """glibc's `renameat2` (2.28+), or None where the C library has none (glibc before 2.28, macOS)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the entries at `a` and `b` (both must exist); False where the kernel (before
    3.15: ENOSYS) or the filesystem (EINVAL) cannot, or the C library has no `renameat2`.

    Raises:
        OSError: any other failure (a missing entry, permissions), with the paths.
    """
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _replace_by_two_renames(tmp: Path, target: Path) -> None:
    """The fallback where no exchange is available: rename() cannot replace a non-empty directory, so
    the old one is moved aside into `.<name>.old-*/` first, then the new one moved in.

    Not atomic: a process killed between the two renames leaves nothing at `target` and the previous
    directory whole at `.<name>.old-*/<name>`, which `sweep_temporaries` moves back. An exception in
    the second rename puts the previous directory back at once.
    """
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / target.name)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old / target.name, target)
        old.rmdir()
        raise
    shutil.rmtree(old)


def _remove(path: Path) -> None:
    """Remove a file, a link (not what it points to) or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def sweep_temporaries(root: str | os.PathLike) -> list[Path]:
    """Remove what writes through this module left behind when their process was killed, anywhere
    under `root`: hidden `.<name>.tmp-XXXXXXXX` (a half-written new version, or an exchanged-out old
    one) and `.<name>.old-XXXXXXXX` entries, where `XXXXXXXX` is `tempfile`'s random suffix. Names
    of any other form are left alone. An `.old-` directory whose `<name>` is missing beside it is
    the previous version a killed fallback save (`_replace_by_two_renames`) had moved aside: it is
    moved back to `<name>` before its empty holder is removed.

    Call it only while no writer is active under `root` (at a service's start): a live write's
    temporary looks the same as a dead one's.

    Returns:
        The temporaries removed, sorted.
    """
    removed = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            if (match := _TEMPORARY_RE.match(name)) is not None:
                removed.append(_sweep(Path(dirpath), name, match["name"], match["kind"]))
        dirnames[:] = [name for name in dirnames if not _TEMPORARY_RE.match(name)]  # removed: not walked
    return sorted(removed)


def _sweep(parent: Path, name: str, target_name: str, kind: str) -> Path:
    """Remove the temporary `parent/name` of `parent/target_name`, first moving back a previous
    version the fallback stranded in it."""
    path, target = parent / name, parent / target_name
    if kind == "old" and os.path.lexists(path / target_name) and not os.path.lexists(target):
        os.replace(path / target_name, target)
    _remove(path)
    return path


@contextlib.contextmanager
def one_builder(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if missing), WAITING for another holder: for
    building something shared in place (a virtualenv, a pip --target directory) that two processes
    must not build at once. Re-check inside whether the other process already built it. The kernel
    drops the lock when its holder dies in any way, so no stale lock is left."""
    Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a fsynced temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, with a failed write (a full disk) raised as the OSError it is,
    naming the file: safetensors raises its own `SafetensorError` ("I/O error: No space left on device
    (os error 28)"), which would otherwise end a run in a traceback instead of one line."""
    import safetensors
    import safetensors.torch

    try:
        safetensors.torch.save_file(tensors, path, metadata=metadata)
    except safetensors.SafetensorError as error:
        code = int(match.group(1)) if (match := re.search(r"os error (\d+)", str(error))) else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from error
