"""safetensors files written one tensor at a time, when every tensor's name, shape and dtype are
known before the first one arrives.

`safetensors.torch.save_file` needs every tensor of a file in memory at once: for merged weights
that is a whole shard (up to 2 GiB), the whole model when it is smaller. Given the layout up front
(`graft.lora.merge.merged_layout`), each file's header is written first and each tensor is written
at its place as it arrives, so a writer holds one tensor at a time. The bytes are `save_file`'s:
the same header (compact JSON, `__metadata__` first, tensors by name, offsets in that order, spaces
to a multiple of 8 bytes) and the data in the same order. Only files of one dtype are laid out here
(`save_file` orders mixed dtypes by its own dtype ranking); merged weights are of one dtype.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
"""(name, shape, dtype) of each tensor, in the order they arrive."""

_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class TensorStream:
    """Named tensors that arrive in the order `layout` lists them (checked as they arrive)."""

    layout: Layout
    tensors: Iterable[tuple[str, torch.Tensor]]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    @property
    def streamable(self) -> bool:
        """One floating dtype throughout (see the module docstring), and at least one tensor."""
        return bool(self.layout) and len({d for _, _, d in self.layout}) == 1 and \
            self.layout[0][2] in _SAFETENSORS_DTYPES


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def layout_bytes(layout: Layout) -> int:
    """The data bytes of every tensor in `layout`."""
    return sum(_nbytes(shape, dtype) for _, shape, dtype in layout)


def plan_shards(layout: Layout, max_shard_bytes: int) -> list[Layout]:
    """Consecutive runs of `layout`, a new one started when the next tensor would pass
    `max_shard_bytes` (the rule of `graft.lora.export.write_safetensors_shards`)."""
    shards: list[Layout] = [[]]
    size = 0
    for entry in layout:
        nbytes = _nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _header(shard: Layout) -> tuple[bytes, dict[str, int]]:
    """The file's header bytes (length prefix included) and each tensor's data offset."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for name, shape, dtype in sorted(shard, key=lambda entry: entry[0]):
        end = at + _nbytes(shape, dtype)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, end]}
        offsets[name] = at
        at = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's data as bytes in host memory: a tensor on a GPU is copied to the CPU first."""
    return tensor.detach().to(device="cpu").contiguous().view(-1).view(torch.uint8).numpy().data


def write_streamed_shards(stream: TensorStream, paths: list[Path], shards: list[Layout]) -> None:
    """Write `stream` into the files `paths`, one per entry of `shards` (`plan_shards`), one tensor at a
    time; a tensor on another device (a GPU's merged weight) is copied to the CPU as it is written.

    Raises:
        ValueError: a tensor is not the one the layout announced (name, shape or dtype), or the
            stream ends early or runs long.
    """
    tensors = iter(stream)
    for path, shard in zip(paths, shards, strict=True):
        header, offsets = _header(shard)
        with open(path, "wb") as f:
            f.write(header)
            for name, shape, dtype in shard:
                got_name, tensor = next(tensors, (None, None))
                if got_name != name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    got = None if tensor is None else (got_name, tuple(tensor.shape), tensor.dtype)
                    raise ValueError(f"tensor stream does not match its layout: expected {(name, shape, dtype)}, "
                                     f"got {got}")
                f.seek(len(header) + offsets[name])
                f.write(_host_bytes(tensor))
    if next(tensors, None) is not None:
        raise ValueError("tensor stream runs past its layout")
