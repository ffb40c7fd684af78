"""Atomic file and directory writes: readers see the old state or the new one, never a partial one.

Everything graft publishes (adapters, merged models, configs) goes through here, so that a crash or
an exception at any instant leaves no half-written file behind at the target path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
    """Yield a temporary sibling of `target` to fill; on success fsync it and rename it into place.

    On an exception the temporary directory is removed and `target` is left as it was.

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
        fsync_tree(tmp)
        if target.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


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
