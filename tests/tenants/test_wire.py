"""graft.tenants.wire speaks the Tinker SDK's protobuf without the SDK: requests the real SDK (tinker 0.38.0) encodes
decode to the SDK's values, results graft encodes decode in the SDK to what was sent (float32 precision), hand-built
bodies the SDK's own parser accepts decode alike, and a malformed body raises WireError and nothing else."""

import random
import struct

import numpy as np
import pytest
import torch
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

from graft.tenants.wire import (
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def _sdk_body(data, loss_fn="cross_entropy", config=None, forward_only=False, seq_id=7) -> bytes:
    """The body the SDK posts to /api/v1/forward_backward (resources/training.py, uncompressed)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess:train:0", seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    """One hand-encoded field; the tests check each body against the SDK's own parser before using it."""
    if wire == 0:
        return _varint(number << 3) + _varint(payload)
    if wire == 2:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload
    return _varint(number << 3 | wire) + payload


UNKNOWN = (_field(90, 0, 300) + _field(91, 1, b"\x01" * 8) + _field(92, 2, b"\xff\x00garbage") + _field(93, 5, b"abcd"))


def _rl_datum(rng: random.Random, length: int) -> types.Datum:
    tokens = [rng.randrange(0, 150_000) for _ in range(length)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
        "target_tokens": tokens[1:] + [rng.randrange(0, 150_000)],
        "logprobs": [rng.uniform(-8, 0) for _ in range(length)],
        "advantages": [rng.uniform(-1, 1) for _ in range(length)],
        "weights": [float(i % 3 != 0) for i in range(length)]})


def test_sdk_request_decodes_to_the_sdk_values():
    rng = random.Random(0)
    data = [_rl_datum(rng, n) for n in (5, 1, 33)]
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "kl_mode": "low_var", "beta": 3}
    request = decode_forward_backward(_sdk_body(data, "ppo", config, forward_only=True, seq_id=41))
    assert (request.model_id, request.seq_id, request.loss_fn) == ("sess:train:0", 41, "ppo")
    assert request.forward_only is True
    assert request.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "kl_mode": "low_var",
                                      "beta": 3.0}
    assert len(request.data) == len(data)
    for got, sent in zip(request.data, data, strict=True):
        assert got.tokens == sent.model_input.to_ints()
        assert set(got.inputs) == set(sent.loss_fn_inputs)
        for name, tensor in got.inputs.items():
            expected = sent.loss_fn_inputs[name]
            assert (tensor.dtype, tensor.shape) == (expected.dtype, tuple(expected.shape))
            assert tensor.values == expected.to_numpy().reshape(-1).tolist()
        assert got.inputs["target_tokens"].dtype == "int64" and got.inputs["weights"].dtype == "float32"
    assert decode_forward_backward(_sdk_body(data[:1])).forward_only is False


def test_chunks_concatenate_and_config_is_left_out_when_none():
    chunks = [types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[]),
              types.EncodedTextChunk(tokens=[2**31 - 1, 0, 9])]
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"weights": [1.0] * 5})
    request = decode_forward_backward(_sdk_body([datum]))
    assert request.data[0].tokens == [1, 2, 2**31 - 1, 0, 9]
    assert request.loss_fn_config == {}


def test_sparse_2d_torch_targets_decode_dense_with_zero_padding():
    gen = torch.Generator().manual_seed(3)
    targets = torch.randint(1, 1000, (4, 9), generator=gen)
    weights = torch.rand(4, 9, generator=gen)
    mask = torch.rand(4, 9, generator=gen) < 0.25
    targets, weights = targets * mask, weights * mask
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(4))),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # the SDK chose CSR
    assert datum.loss_fn_inputs["weights"].sparse_crow_indices is not None
    inputs = decode_forward_backward(_sdk_body([datum])).data[0].inputs
    assert inputs["target_tokens"].shape == (4, 9) and inputs["target_tokens"].dtype == "int64"
    assert inputs["target_tokens"].values == targets.reshape(-1).tolist()
    assert inputs["weights"].values == weights.reshape(-1).tolist()


def test_any_field_order_unknown_fields_and_unpacked_shape():
    values = np.array([[1.5, -2.0, 0.25], [4.0, 5.0, 6.0]], "<f4")
    tensor = (_field(4, 0, 2) + UNKNOWN + _field(3, 0, 1) + _field(4, 0, 3)  # shape unpacked, split around others
              + _field(1, 2, values.tobytes()))
    entry = _field(2, 2, tensor) + _field(1, 2, b"advantages")  # value before key
    chunk = _field(1, 2, UNKNOWN + _field(1, 2, np.array([5, 6], "<i4").tobytes()))
    datum = _field(2, 2, entry) + UNKNOWN + _field(1, 2, chunk)
    body = (_field(6, 0, 1) + _field(3, 2, datum) + UNKNOWN + _field(4, 2, b"importance_sampling")
            + _field(2, 0, -5) + _field(1, 2, "modèle".encode()))
    sdk = pb.ForwardBackwardRequest.FromString(body)
    assert list(sdk.data[0].loss_fn_inputs["advantages"].shape) == [2, 3] and sdk.seq_id == -5
    request = decode_forward_backward(body)
    assert (request.model_id, request.seq_id, request.loss_fn) == ("modèle", -5, "importance_sampling")
    assert request.forward_only is True and request.data[0].tokens == [5, 6]
    assert request.data[0].inputs["advantages"].shape == (2, 3)
    assert request.data[0].inputs["advantages"].values == values.reshape(-1).tolist()


def test_map_entries_missing_key_or_value_take_proto3_defaults_and_v2_overrides():
    legacy = [_field(2, 1, struct.pack("<d", 0.5)), _field(1, 2, b"eps"), _field(1, 2, b"beta")
              + _field(2, 1, struct.pack("<d", 1.0))]
    v2 = [_field(1, 2, b"beta") + _field(2, 2, _field(2, 2, b"adaptive")), _field(1, 2, b"gamma"),
          _field(1, 2, b"tau") + _field(2, 2, _field(1, 1, struct.pack("<d", -3.0)))]
    body = b"".join(_field(5, 2, e) for e in legacy) + b"".join(_field(7, 2, e) for e in v2)
    sdk = pb.ForwardBackwardRequest.FromString(body)
    assert dict(sdk.loss_fn_config) == {"": 0.5, "eps": 0.0, "beta": 1.0}
    assert decode_forward_backward(body).loss_fn_config == {"": 0.5, "eps": 0.0, "beta": "adaptive", "gamma": 0.0,
                                                            "tau": -3.0}


def _decode_fb(body: bytes) -> types.ForwardBackwardOutput:
    return deserialize_proto_response(body, types.ForwardBackwardOutput)


def test_forward_backward_output_reads_back_in_the_sdk():
    rng = random.Random(1)
    outputs = [{"logprobs": [rng.uniform(-9, 0) for _ in range(n)],
                "elementwise_loss": [rng.random() for _ in range(n)]} for n in (3, 0, 17)]
    metrics = {"loss:sum": 12.345678901234, "clip_fraction:mean": 0.125, "tokens:sum": 20.0}
    result = _decode_fb(encode_forward_backward_output(outputs, metrics))
    assert result.loss_fn_output_type == "ArrayRecord" and result.metrics == metrics
    assert len(result.loss_fn_outputs) == len(outputs)
    for got, sent in zip(result.loss_fn_outputs, outputs, strict=True):
        assert set(got) == set(sent)
        for name, values in sent.items():
            assert got[name].dtype == "float32" and got[name].shape == [len(values)]
            assert got[name].tolist() == np.asarray(values, np.float32).tolist()
    combined = combine_fwd_bwd_output_results([result, result])  # what forward_backward(...).result() runs
    assert combined.metrics["loss:sum"] == pytest.approx(2 * metrics["loss:sum"])


def test_forward_backward_output_without_datums_or_fields():
    assert _decode_fb(encode_forward_backward_output([], {"loss:sum": 0.0})).loss_fn_outputs == []
    assert _decode_fb(encode_forward_backward_output([{}, {}], {})).loss_fn_outputs == [{}, {}]
    with pytest.raises(ValueError, match="output 1"):
        encode_forward_backward_output([{"logprobs": [0.0]}, {}], {})


def test_sample_response_reads_back_in_the_sdk():
    sequences = [([11, 2**31 - 1, 0], [-0.1, -2.7182818, -30.0], "stop"), ([], [], "length"), ([5], [-1e-9], "length")]
    response = deserialize_proto_response(encode_sample_response(sequences, [None, -1.25, None, -0.3]),
                                          types.SampleResponse)
    assert response.prompt_logprobs == [None, -1.25, None, pytest.approx(-0.3, rel=1e-7)]
    assert [s.stop_reason for s in response.sequences] == ["stop", "length", "length"]
    assert [s.tokens for s in response.sequences] == [t for t, _, _ in sequences]
    first = response.sequences[0].logprobs
    assert first == np.asarray(sequences[0][1], np.float32).tolist()
    plain = deserialize_proto_response(encode_sample_response(sequences[:1]), types.SampleResponse)
    assert plain.prompt_logprobs is None and len(plain.sequences) == 1
    with pytest.raises(ValueError, match="stop reason"):
        encode_sample_response([([1], [0.0], "eos")])


def test_image_chunk_is_refused_naming_the_datum():
    text = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"weights": [1.0, 1.0]})
    image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                        loss_fn_inputs={"weights": [1.0]})
    with pytest.raises(WireError, match=r"^datum 3: image chunks are not supported; send encoded_text$"):
        decode_forward_backward(_sdk_body([text, text, text, image]))


def _tensor_body(tensor: bytes) -> bytes:
    entry = _field(1, 2, b"weights") + _field(2, 2, tensor)
    return _field(3, 2, _field(2, 2, entry))


def _csr_body(values: list[int], crow: list[int], cols: list[int], shape: tuple[int, int]) -> bytes:
    csr = b"".join(_field(n, 2, np.array(a, "<i8").tobytes()) for n, a in ((1, values), (2, crow), (3, cols)))
    return _tensor_body(_field(3, 0, 2) + _field(4, 2, b"".join(map(_varint, shape))) + _field(2, 2, csr))


@pytest.mark.parametrize("body, match", [
    (_field(1, 2, b"abc")[:-1], "field 1 needs 3 bytes"),
    (b"\x0b", "wire type 3"),
    (b"\x10" + b"\xff" * 11, "varint longer"),
    (b"\x10\xff", "truncated varint"),
    (b"\x00\x01", "field number 0"),
    (_field(1, 0, 5), r"model_id: wire type 0"),
    (_field(1, 2, b"\xff\xfe"), "not UTF-8"),
    (_field(3, 2, _field(1, 2, _field(1, 2, _field(1, 2, b"\x01\x00\x00")))), r"datum 0: chunk 0: tokens: 3 bytes"),
    (_field(3, 2, _field(1, 2, b"")), "datum 0: chunk 0 holds no encoded_text"),
    (_field(3, 2, _field(1, 2, _field(3, 2, b"\x00"))), "dmel chunks are not supported"),
    (_tensor_body(_field(3, 0, 4) + _field(1, 2, b"\x00\x00")), "dtype 4 is not supported"),
    (_tensor_body(_field(3, 0, 1) + _field(1, 2, b"\x00" * 6)), "6 bytes is not a whole number"),
    (_tensor_body(_field(3, 0, 1) + _field(4, 0, 3) + _field(1, 2, b"\x00" * 8)), "dense holds 2 values"),
    (_tensor_body(_field(3, 0, 1) + _field(4, 0, -1)), "negative dimension"),
    (_tensor_body(_field(3, 0, 2) + _field(4, 0, 4) + _field(2, 2, b"")), "needs a 2-D shape"),
    (_csr_body([7], [0, 1, 2], [0], (2, 3)), "indices do not describe 1 values"),
    (_csr_body([7], [0, 1, 1], [3], (2, 3)), "column indices do not fit"),
    (_csr_body([], [], [], (1 << 20, 1 << 20)), "too large"),
])
def test_malformed_bodies_raise_wire_error(body, match):
    with pytest.raises(WireError, match=match):
        decode_forward_backward(body)


def test_truncated_and_corrupted_sdk_bodies_raise_only_wire_error():
    rng = random.Random(2)
    body = _sdk_body([_rl_datum(rng, 6), _rl_datum(rng, 3)], "ppo", {"beta": 0.1, "mode": "x"})
    targets = torch.tensor([[0, 3, 0, 0], [0, 0, 0, 9], [0, 0, 0, 0]])
    sparse = _sdk_body([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                    loss_fn_inputs={"target_tokens": targets})])
    refused = 0
    for sample in (body, sparse):
        variants = [sample[:cut] for cut in range(len(sample))]
        for _ in range(300):
            corrupted = bytearray(sample)
            corrupted[rng.randrange(len(sample))] = rng.randrange(256)
            variants.append(bytes(corrupted))
        for variant in variants:
            try:
                decode_forward_backward(variant)
            except WireError:
                refused += 1
    assert refused > len(body)  # most truncations cut a field short
