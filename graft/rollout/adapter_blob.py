"""An adapter as one blob: the safetensors format, the PEFT config in its metadata, held in bytes or in a
shared-memory segment of this host.

The wire format of adapters that reach an engine from memory (`RolloutEngine.load_adapter_blob`;
vLLM's side: graft.rollout.vllm.server.lora_memory). Made once per version and sent as it is to every
engine of a pool. Written here rather than by `safetensors.torch.save` so that each tensor is copied
once, straight into its place (measured at the Qwen2.5-0.5B shape, r16, 16.8 MiB: safetensors' save
17 ms, then 5 ms more to put its bytes in a segment); read here as views of a copy-on-write map
(no copy; what the engine scales in place stays in that map) or as fresh copies of bytes.

Segments live in /dev/shm, readable by this user only, named `graft-lora-<creator pid>-<16 hex>`. A
one-off segment is unlinked by its creator once the load call returned (a reader that mapped it
keeps its pages). A trainer reuses its segments instead (`SegmentPool`): a new tmpfs segment pays
for its pages at every version (measured at the 0.5B shape, 16.8 MiB, on 2 loaded cores: 35-70 ms
to create and fill, against 17 ms for everything else of a sync by shm), a reused one only the copy.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import secrets
import struct
import warnings
from dataclasses import dataclass

import torch

CONFIG_KEY = "adapter_config"  # safetensors metadata: the adapter_config.json text
SHM_DIR = "/dev/shm"
SEGMENT_RE = re.compile(r"graft-lora-(?P<pid>[0-9]+)-[0-9a-f]{16}")
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


class BlobError(ValueError):
    """Bytes that are not an adapter blob, or a segment that cannot be read."""


@dataclass(frozen=True)
class SharedBlob:
    """A blob in shared-memory segment `segment` of this host, `size` bytes long."""

    segment: str
    size: int

    def release(self) -> None:
        drop_segment(self.segment)


def folded_scaling(config: dict) -> tuple[dict, float]:
    """(the config of the same adapter with its LoRA scaling folded into lora_B, the factor lora_B is
    multiplied by); (config, 1.0) when there is nothing to fold or per-module patterns set the scaling.

    Why: vLLM folds the scaling itself at every build (`LoRALayerWeights.optimize`: `lora_b *= scaling`
    unless the scaling is 1), writing every lora_B page of its copy-on-write map: 9 ms of a 23 ms
    `add_lora` at the Qwen2.5-0.5B shape, r16 (2-core AMD EPYC). Folded while the blob is written (the
    same bf16 multiply vLLM does, so the served weights are bit-equal), nothing is written at build.
    Not for files a user keeps: PEFT refuses a checkpoint whose alpha differs from the model's."""
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        return config, 1.0
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if scaling == 1:
        return config, 1.0
    return {**config, "lora_alpha": rank, "use_rslora": False}, scaling


@dataclass(frozen=True)
class _Placed:
    """Where a tensor goes in a blob: at `offset` after the prefix, as `dtype`, times `factor`."""

    tensor: torch.Tensor
    offset: int
    dtype: torch.dtype
    factor: float


def _layout(tensors: dict[str, torch.Tensor], config: dict, *, dtype: torch.dtype | None, fold_scaling: bool
            ) -> tuple[bytes, list[_Placed], int]:
    """The blob's prefix (length + JSON header), where each tensor goes, and the blob's size. Tensors
    are written as `dtype` (default their own), lora_B times the folded scaling (`folded_scaling`)."""
    config, scaling = folded_scaling(config) if fold_scaling else (config, 1.0)
    header: dict = {"__metadata__": {"format": "pt", CONFIG_KEY: json.dumps(config, sort_keys=True)}}
    placed, offset = [], 0
    for key, tensor in tensors.items():
        stored = dtype or tensor.dtype
        if stored not in _DTYPES:
            raise BlobError(f"{key}: an adapter blob carries {sorted(_DTYPES.values())}, not {stored}")
        size = tensor.numel() * stored.itemsize
        header[key] = {"dtype": _DTYPES[stored], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        placed.append(_Placed(tensor, offset, stored, scaling if ".lora_B." in key else 1.0))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned, as safetensors writes them
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, placed, len(prefix) + offset


def _fill(buffer, prefix: bytes, placed: list[_Placed]) -> None:
    """Write the blob into the writable `buffer`: each tensor converted as it is copied (from any device),
    then multiplied in place where a scaling is folded in (in the stored dtype: vLLM's own multiply)."""
    buffer[:len(prefix)] = prefix
    for place in placed:
        if not place.tensor.numel():
            continue
        target = torch.frombuffer(buffer, dtype=place.dtype, count=place.tensor.numel(),
                                  offset=len(prefix) + place.offset).view(place.tensor.shape)
        target.copy_(place.tensor.detach())
        if place.factor != 1:
            target.mul_(place.factor)


def adapter_blob(tensors: dict[str, torch.Tensor], config: dict, *, dtype: torch.dtype | None = None,
                 fold_scaling: bool = False) -> bytes:
    """`tensors` (PEFT names) and the PEFT `config` as one blob in bytes (for an HTTP body): each tensor
    as `dtype` (default its own); with `fold_scaling`, the same adapter with its scaling folded into
    lora_B (`folded_scaling`)."""
    prefix, placed, size = _layout(tensors, config, dtype=dtype, fold_scaling=fold_scaling)
    buffer = bytearray(size)
    _fill(buffer, prefix, placed)
    return bytes(buffer)


def _segment_name() -> str:
    return f"graft-lora-{os.getpid()}-{secrets.token_hex(8)}"


class SegmentPool:
    """A trainer's shared-memory segments, reused across versions (module docstring).

    `write(key, ...)` puts a blob in a free segment of its size (or a new one) and holds it for `key`
    (a version) until `release(key)`: the engine maps the segment while that version is loaded and
    rebuilds from it after an LRU eviction, so it is rewritten only once the version was unloaded.
    `close()` unlinks every segment (an engine's maps keep their pages). Segments of creators that
    died without closing (SIGKILL) are removed when the next pool starts.
    """

    def __init__(self) -> None:
        self._free: list[tuple[str, mmap.mmap]] = []
        self._held: dict[int, tuple[str, mmap.mmap]] = {}
        _remove_orphans()

    def write(self, key: int, tensors: dict[str, torch.Tensor], config: dict, *, dtype: torch.dtype | None = None,
              fold_scaling: bool = False) -> SharedBlob:
        """`adapter_blob`'s blob, in a segment held for `key`."""
        prefix, placed, size = _layout(tensors, config, dtype=dtype, fold_scaling=fold_scaling)
        reusable = next((i for i, (_, buffer) in enumerate(self._free) if len(buffer) == size), None)
        name, buffer = self._free.pop(reusable) if reusable is not None else _create_segment(size)
        try:
            _fill(buffer, prefix, placed)
        except BaseException:
            self._free.append((name, buffer))
            raise
        self._held[key] = (name, buffer)
        return SharedBlob(name, size)

    def contents(self, key: int) -> bytes:
        """A copy of the blob held for `key`."""
        return bytes(self._held[key][1])

    def release(self, key: int) -> None:
        """`key`'s segment may be rewritten (its version is no longer loaded anywhere)."""
        if (held := self._held.pop(key, None)) is not None:
            self._free.append(held)

    def close(self) -> None:
        for name, buffer in [*self._free, *self._held.values()]:
            buffer.close()
            drop_segment(name)
        self._free, self._held = [], {}


def _create_segment(size: int) -> tuple[str, mmap.mmap]:
    """A new segment of `size` bytes, mapped for writing."""
    name = _segment_name()
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return name, mmap.mmap(fd, size)
    except BaseException:
        drop_segment(name)
        raise
    finally:
        os.close(fd)


def _remove_orphans() -> None:
    """Unlink the segments of creators no longer alive."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if (match := SEGMENT_RE.fullmatch(name)) and not _alive(int(match["pid"])):
            drop_segment(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def segment_path(name: str) -> str:
    """The file of segment `name`. Names are checked: a server must never open an arbitrary file for a client.

    Raises:
        BlobError: not a graft segment name.
    """
    if not SEGMENT_RE.fullmatch(name):
        raise BlobError(f"not a graft shared-memory segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def new_segment(data: bytes) -> SharedBlob:
    """A new segment holding `data` (what a server does with a blob that came in a request body)."""
    name = _segment_name()
    fd = os.open(os.path.join(SHM_DIR, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as segment:
        segment.write(data)
    return SharedBlob(name, len(data))


def open_segment(name: str) -> int:
    """A read-only descriptor of segment `name`: its pages stay reachable after the creator unlinks the name.

    Raises:
        BlobError: a bad name, or no such segment on this host.
    """
    try:
        return os.open(segment_path(name), os.O_RDONLY)
    except FileNotFoundError:
        raise BlobError(f"no shared-memory segment {name!r} on the server's host (the shm transport needs "
                        "trainer and server on one host)") from None


def map_copy_on_write(fd: int) -> mmap.mmap:
    """The segment behind `fd` mapped copy-on-write: no byte is copied, and what is written through the
    map (vLLM scales `lora_b` in place) stays in this map's own pages, never reaching the segment."""
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)


def map_segment(name: str) -> mmap.mmap:
    """Segment `name` mapped copy-on-write (`map_copy_on_write`)."""
    fd = open_segment(name)
    try:
        return map_copy_on_write(fd)
    finally:
        os.close(fd)


def drop_segment(name: str) -> None:
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass


def _header(blob) -> tuple[dict, int]:
    """The parsed JSON header and where the tensor data starts."""
    try:
        (length,) = struct.unpack("<Q", blob[:8])
        header = json.loads(bytes(blob[8:8 + length]))
    except (struct.error, ValueError, TypeError):
        raise BlobError("not a safetensors blob") from None
    if not isinstance(header, dict):
        raise BlobError("not a safetensors blob")
    return header, 8 + length


def blob_config(blob) -> dict:
    """The PEFT config in a blob's metadata (header only: no tensor is decoded).

    Raises:
        BlobError: not a safetensors blob, or no parsable `CONFIG_KEY` in its metadata.
    """
    try:
        config = json.loads(_header(blob)[0]["__metadata__"][CONFIG_KEY])
    except (BlobError, ValueError, KeyError, TypeError):
        raise BlobError(f"expected a safetensors blob whose metadata holds the PEFT config under "
                        f"{CONFIG_KEY!r}") from None
    if not isinstance(config, dict):
        raise BlobError(f"the blob's {CONFIG_KEY!r} is not a JSON object")
    return config


def blob_tensors(blob, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of `blob` (bytes or a map): each copied once into fresh memory, or with `copy=False`
    views of the blob itself (for a copy-on-write map that nothing else reads).

    Raises:
        BlobError: a malformed header, an unknown dtype, or data outside the blob.
    """
    header, start = _header(blob)
    tensors = {}
    with warnings.catch_warnings():  # a read-only buffer is only ever cloned
        warnings.simplefilter("ignore", UserWarning)
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = _TORCH_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
                count = (end - begin) // torch.empty((), dtype=dtype).element_size()
                view = torch.frombuffer(blob, dtype=dtype, count=count, offset=start + begin) if count else \
                    torch.empty(0, dtype=dtype)
                tensors[key] = view.reshape(shape).clone() if copy else view.reshape(shape)
            except (KeyError, TypeError, ValueError, RuntimeError) as error:
                raise BlobError(f"tensor {key!r}: {error}") from None
    return tensors
