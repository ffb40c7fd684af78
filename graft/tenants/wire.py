"""Graft's own codec for the Tinker API's protobuf messages.

The `tinker` SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` and accepts
`ForwardBackwardOutput` and `SampleResponse` results only as protobuf. The service reads and writes them here,
so that serving tenants needs neither the client SDK nor google.protobuf. The schema is `tinker_public` of
tinker 0.38.0 (proto3, little-endian payloads); this codec covers only what a LoRA training and sampling service
uses:

* read: `ForwardBackwardRequest` (model_id, seq_id, data, loss_fn, loss_fn_config and loss_fn_config_v2,
  forward_only); each `Datum`'s encoded_text chunks (int32 tokens) and its loss_fn_inputs as dense or 2-D sparse
  CSR tensors of float32 or int64. Provenance spans and unknown fields are skipped; image and dmel chunks are
  refused, since the service trains text models only.
* write: `ForwardBackwardOutput` as one `ArrayRecord` of float32 `BatchedTensor`s, and `SampleResponse` with its
  sequences and prompt logprobs (no top-k logprobs, no target or alternative prompt tensors).

A body that is not such a message raises `WireError` naming the message and field, never a lower-level error: the
body comes from the network, and the service answers it with a 400.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_WIRE_OF = {"int": VARINT, "double": I64, "str": LEN, "bytes": LEN, "msgs": LEN}
_DTYPES = {1: ("float32", "<f4"), 2: ("int64", "<i8")}
_STOP_REASONS = {"stop": 0, "length": 1}
_MAX_SPARSE_CELLS = 1 << 28  # a sparse tensor is densified; refuse one that would take gigabytes

_REQUEST = {1: ("model_id", "str"), 2: ("seq_id", "int"), 3: ("data", "msgs"), 4: ("loss_fn", "str"),
            5: ("loss_fn_config", "msgs"), 6: ("forward_only", "int"), 7: ("loss_fn_config_v2", "msgs")}
_DATUM = {1: ("model_input", "msgs"), 2: ("loss_fn_inputs", "msgs")}
_CHUNK = {1: ("encoded_text", "bytes"), 2: ("image", "bytes"), 3: ("dmel", "bytes")}
_TEXT = {1: ("tokens", "bytes")}
_TENSOR = {1: ("dense", "bytes"), 2: ("sparse_csr", "bytes"), 3: ("dtype", "int"), 4: ("shape", "ints")}
_CSR = {1: ("values", "bytes"), 2: ("crow_indices", "bytes"), 3: ("col_indices", "bytes")}
_CONFIG_VALUE = {1: ("number", "double"), 2: ("text", "str")}


class WireError(ValueError):
    """A body that is not a valid message of the expected kind; the message says what and where."""


@dataclass(frozen=True)
class WireTensor:
    """A `Tensor` of loss_fn_inputs, dense (a sparse CSR tensor is expanded with 0 in the absent cells)."""

    values: list[float] | list[int]  # flat, row-major
    dtype: str  # "float32" | "int64"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WireDatum:
    tokens: list[int]  # the encoded_text chunks of model_input, concatenated
    inputs: dict[str, WireTensor]  # loss_fn_inputs


@dataclass(frozen=True)
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    data: list[WireDatum]
    loss_fn: str
    loss_fn_config: dict[str, float | str]  # loss_fn_config, then loss_fn_config_v2 overriding it
    forward_only: bool


def _varint(buf: memoryview, pos: int, where: str) -> tuple[int, int]:
    """The unsigned varint at `pos` (at most 10 bytes, kept to 64 bits) and the position after it."""
    result = shift = 0
    while shift < 70:
        if pos >= len(buf):
            raise WireError(f"{where}: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
    raise WireError(f"{where}: varint longer than 10 bytes")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _scan(buf: memoryview, where: str) -> Iterator[tuple[int, int, int | memoryview]]:
    """Each field of a message as (number, wire type, value): an int for a varint, the payload otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError(f"{where}: field number 0 at byte {pos}")
        if wire == VARINT:
            value, pos = _varint(buf, pos, where)
            yield number, wire, value
            continue
        if wire == LEN:
            size, pos = _varint(buf, pos, where)
        elif wire in (I64, I32):
            size = 8 if wire == I64 else 4
        else:
            raise WireError(f"{where}: field {number} has wire type {wire} (groups are not supported)")
        if size > len(buf) - pos:
            raise WireError(f"{where}: field {number} needs {size} bytes, {len(buf) - pos} are left")
        yield number, wire, buf[pos:pos + size]
        pos += size


def _fields(buf: memoryview, spec: dict[int, tuple[str, str]], where: str) -> dict:
    """The fields of `spec` found in a message, by name: repeated ones ("msgs", "ints") as lists, the last
    occurrence of the others. Fields not in `spec` are skipped."""
    out: dict = {}
    for number, wire, raw in _scan(buf, where):
        if number not in spec:
            continue
        name, kind = spec[number]
        here = f"{where}.{name}"
        if kind == "ints":
            out.setdefault(name, []).extend(_ints(wire, raw, here))
        elif wire != _WIRE_OF[kind]:
            raise WireError(f"{here}: wire type {wire}, expected {_WIRE_OF[kind]}")
        elif kind == "msgs":
            out.setdefault(name, []).append(raw)
        elif kind == "int":
            out[name] = _signed(raw)
        elif kind == "double":
            out[name] = struct.unpack("<d", raw)[0]
        elif kind == "str":
            out[name] = _text(raw, here)
        else:
            out[name] = raw
    return out


def _ints(wire: int, raw: int | memoryview, where: str) -> list[int]:
    """A repeated int64 field's values from one occurrence, packed (LEN) or not (VARINT)."""
    if wire == VARINT:
        return [_signed(raw)]
    if wire != LEN:
        raise WireError(f"{where}: wire type {wire}, expected {VARINT} or {LEN}")
    values, pos = [], 0
    while pos < len(raw):
        value, pos = _varint(raw, pos, where)
        values.append(_signed(value))
    return values


def _text(raw: memoryview, where: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{where}: not UTF-8") from None


def _entry(raw: memoryview, value_kind: str, where: str) -> tuple[str, object]:
    """A map entry's key and value; proto3 defaults ("" and None) where the entry leaves one out."""
    f = _fields(raw, {1: ("key", "str"), 2: ("value", value_kind)}, where)
    return f.get("key", ""), f.get("value")


def _array(raw: memoryview | bytes, dtype: str, where: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {itemsize}-byte values")
    return np.frombuffer(raw, dtype)


def decode_forward_backward(body: bytes) -> ForwardBackwardRequest:
    """The `ForwardBackwardRequest` in `body` (uncompressed)."""
    where = "ForwardBackwardRequest"
    f = _fields(memoryview(body), _REQUEST, where)
    config: dict[str, float | str] = {}
    for raw in f.get("loss_fn_config", []):
        key, value = _entry(raw, "double", f"{where}.loss_fn_config")
        config[key] = 0.0 if value is None else value
    for raw in f.get("loss_fn_config_v2", []):
        key, value = _entry(raw, "bytes", f"{where}.loss_fn_config_v2")
        config[key] = _config_value(b"" if value is None else value, f"{where}.loss_fn_config_v2[{key!r}]")
    return ForwardBackwardRequest(
        model_id=f.get("model_id", ""), seq_id=f.get("seq_id", 0),
        data=[_datum(raw, i) for i, raw in enumerate(f.get("data", []))],
        loss_fn=f.get("loss_fn", ""), loss_fn_config=config, forward_only=bool(f.get("forward_only", 0)))


def _config_value(raw: memoryview | bytes, where: str) -> float | str:
    """A `LossConfigValue`: its text or number; 0.0 when it holds neither."""
    f = _fields(memoryview(raw), _CONFIG_VALUE, where)
    return f.get("text", f.get("number", 0.0))


def _datum(raw: memoryview, index: int) -> WireDatum:
    """Datum `index` (0-based) of the request."""
    where = f"datum {index}"
    f = _fields(raw, _DATUM, where)
    chunks = [_chunk_tokens(chunk, where, j) for j, chunk in enumerate(f.get("model_input", []))]
    inputs = {}
    for entry in f.get("loss_fn_inputs", []):
        key, value = _entry(entry, "bytes", f"{where}: loss_fn_inputs")
        inputs[key] = _tensor(memoryview(b"" if value is None else value), f"{where}: loss_fn_inputs[{key!r}]")
    tokens = np.concatenate(chunks).tolist() if chunks else []
    return WireDatum(tokens=tokens, inputs=inputs)


def _chunk_tokens(raw: memoryview, where: str, index: int) -> np.ndarray:
    f = _fields(raw, _CHUNK, f"{where}: chunk {index}")
    if "image" in f or "dmel" in f:
        raise WireError(f"{where}: {'image' if 'image' in f else 'dmel'} chunks are not supported; send encoded_text")
    if "encoded_text" not in f:
        raise WireError(f"{where}: chunk {index} holds no encoded_text")
    text = _fields(f["encoded_text"], _TEXT, f"{where}: chunk {index}")
    return _array(text.get("tokens", b""), "<i4", f"{where}: chunk {index}: tokens")


def _tensor(raw: memoryview, where: str) -> WireTensor:
    """A `Tensor`, dense; a missing shape means 1-D."""
    f = _fields(raw, _TENSOR, where)
    code = f.get("dtype", 0)
    if code not in _DTYPES:
        raise WireError(f"{where}: dtype {code} is not supported (FLOAT32 = 1 or INT64 = 2)")
    name, dtype = _DTYPES[code]
    shape = tuple(f.get("shape", ()))
    if any(d < 0 for d in shape):
        raise WireError(f"{where}: negative dimension in shape {list(shape)}")
    if "sparse_csr" in f:
        array = _csr(f["sparse_csr"], dtype, shape, where)
    else:
        array = _array(f.get("dense", b""), dtype, f"{where}: dense")
        shape = shape or (array.size,)
        if array.size != math.prod(shape):
            raise WireError(f"{where}: dense holds {array.size} values, shape {list(shape)} needs {math.prod(shape)}")
    return WireTensor(values=array.tolist(), dtype=name, shape=shape)


def _csr(raw: memoryview, dtype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A sparse CSR matrix, expanded to a flat dense array with 0 in the absent cells."""
    if len(shape) != 2:
        raise WireError(f"{where}: sparse_csr needs a 2-D shape, not {list(shape)}")
    rows, width = shape
    if rows * width > _MAX_SPARSE_CELLS:
        raise WireError(f"{where}: sparse_csr shape {list(shape)} is too large to expand")
    here = f"{where}: sparse_csr"
    f = _fields(raw, _CSR, here)
    values = _array(f.get("values", b""), dtype, f"{here}.values")
    crow = _array(f.get("crow_indices", b""), "<i8", f"{here}.crow_indices")
    cols = _array(f.get("col_indices", b""), "<i8", f"{here}.col_indices")
    counts = np.diff(crow)
    if len(crow) != rows + 1 or crow[0] != 0 or (counts < 0).any() or crow[-1] != len(values):
        raise WireError(f"{here}: indices do not describe {len(values)} values in a {rows}x{width} matrix")
    if len(cols) != len(values) or (cols.size and (cols.min() < 0 or cols.max() >= width)):
        raise WireError(f"{here}: column indices do not fit {len(values)} values in {width} columns")
    dense = np.zeros(shape, dtype)
    dense[np.repeat(np.arange(rows), counts), cols] = values
    return dense.reshape(-1)


def _uvarint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _uvarint(number << 3 | LEN) + _uvarint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _uvarint(number << 3 | VARINT) + _uvarint(value)


def _map_entry(number: int, key: str, value: bytes) -> bytes:
    """A map entry of field `number`; `value` is already encoded as field 2."""
    return _len_field(number, _len_field(1, key.encode()) + value)


def encode_forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: `outputs` (one dict per datum, the same names in each) as float32 vectors of one
    `ArrayRecord`, and `metrics` under their keys as given (the SDK needs "name:reduction")."""
    names = list(outputs[0]) if outputs else []
    for i, output in enumerate(outputs):
        if set(output) != set(names):
            raise ValueError(f"output {i} has fields {sorted(output)}, output 0 has {sorted(names)}")
    fields = b"".join(_map_entry(2, name, _len_field(2, _batched([o[name] for o in outputs]))) for name in names)
    record = _len_field(1, b"ArrayRecord") + fields + _int_field(3, len(outputs))
    metric_entries = b"".join(_map_entry(3, k, _uvarint(2 << 3 | I64) + struct.pack("<d", float(v)))
                              for k, v in metrics.items())
    return _len_field(1, b"ArrayRecord") + _len_field(2, record) + metric_entries


def _batched(per_datum: list[list[float]]) -> bytes:
    """A float32 `BatchedTensor` of one vector per datum: their bytes concatenated, int64 byte offsets."""
    arrays = [np.asarray(values, "<f4").reshape(-1) for values in per_datum]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    data = b"".join(a.tobytes() for a in arrays)
    return _len_field(1, data) + _len_field(2, offsets.tobytes()) + _int_field(3, 1)


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: list[float | None] | None = None) -> bytes:
    """A `SampleResponse`: each sequence as (tokens, their logprobs, stop reason "stop" or "length"), and the prompt's
    logprobs when given (NaN for None, which the SDK reads back as None)."""
    body = b"".join(_len_field(1, _sequence(*sequence)) for sequence in sequences)
    if prompt_logprobs is not None:
        lp = np.array([math.nan if x is None else x for x in prompt_logprobs], "<f4")
        body += _len_field(2, lp.tobytes())
    return body


def _sequence(tokens: list[int], logprobs: list[float], stop_reason: str) -> bytes:
    if stop_reason not in _STOP_REASONS:
        raise ValueError(f"stop reason {stop_reason!r} is not one of {sorted(_STOP_REASONS)}")
    if len(logprobs) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
    return (_int_field(1, _STOP_REASONS[stop_reason]) + _len_field(2, np.asarray(tokens, "<i4").tobytes())
            + _len_field(3, np.asarray(logprobs, "<f4").tobytes()))
