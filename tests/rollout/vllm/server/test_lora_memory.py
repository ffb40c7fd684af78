"""Adapters loaded from memory (graft.rollout.vllm.server.lora_memory): the wire format and segments
here, and against the real vLLM server: served exactly as the same adapter loaded from disk, by both
transports, bit-equal again after any number of LRU evictions, refused with vLLM's own validation,
and nothing left staged in the workers after an unload or a refused load."""

import asyncio
import os
import stat
import subprocess
import sys

import httpx
import pytest
import torch

from graft.lora.adapter_io import save_adapter
from graft.rollout.adapter_blob import (
    SHM_DIR,
    BlobError,
    SegmentPool,
    SharedBlob,
    adapter_blob,
    blob_config,
    blob_tensors,
    folded_scaling,
    map_segment,
    new_segment,
)
from graft.rollout.engine import (
    EngineError,
    GenerateRequest,
    SamplingParams,
    TransportUnsupportedError,
)
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.server.lora_memory import memory_path, memory_segment
from graft.sync.source import policy_source
from tests.helpers import trained_like_peft_model
from tests.sync.common import staged_labels

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 301, 302]]


def test_a_blob_carries_its_tensors_and_config_and_safetensors_reads_it():
    import safetensors.torch

    tensors = {"a.lora_A.weight": torch.randn(2, 3), "a.lora_B.weight": torch.randn(3, 2).to(torch.bfloat16),
               "empty": torch.zeros(0, 4)}
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["a"]}
    blob = adapter_blob(tensors, config)
    assert blob_config(blob) == config
    for decoded in (safetensors.torch.load(blob), blob_tensors(blob)):
        assert decoded.keys() == tensors.keys()
        assert all(decoded[k].dtype == t.dtype and torch.equal(decoded[k], t) for k, t in tensors.items())
    segments = SegmentPool()
    try:
        shared = segments.write(1, tensors, config)
        mapped = map_segment(shared.segment)
        assert bytes(mapped) == blob and shared.size == len(blob)
        fresh = blob_tensors(mapped)
        fresh["a.lora_A.weight"] *= 2  # what vLLM's optimize() does to lora_b: the blob stays as it was
        assert torch.equal(blob_tensors(mapped)["a.lora_A.weight"], tensors["a.lora_A.weight"])
    finally:
        segments.close()


@pytest.mark.parametrize("config, served, scaling", [
    ({"r": 8, "lora_alpha": 12}, {"r": 8, "lora_alpha": 8, "use_rslora": False}, 1.5),
    ({"r": 16, "lora_alpha": 16, "use_rslora": True}, {"r": 16, "lora_alpha": 16, "use_rslora": False}, 4.0),
    ({"r": 8, "lora_alpha": 8}, {"r": 8, "lora_alpha": 8}, 1.0),  # nothing to fold
    ({"r": 8, "lora_alpha": 16, "alpha_pattern": {"q_proj": 4}}, None, 1.0),  # per-module scaling: as it is
])
def test_folding_the_scaling_keeps_the_adapters_function(config, served, scaling):
    lora_a, lora_b = torch.randn(config["r"], 5), torch.randn(7, config["r"]).to(torch.bfloat16)
    tensors = {"m.q_proj.lora_A.weight": lora_a, "m.q_proj.lora_B.weight": lora_b}
    folded = adapter_blob(tensors, config, fold_scaling=True)
    assert folded_scaling(config) == (served or config, scaling)
    assert blob_config(folded) == (served or config)
    decoded = blob_tensors(folded)
    assert torch.equal(decoded["m.q_proj.lora_A.weight"], lora_a)
    assert torch.equal(decoded["m.q_proj.lora_B.weight"], lora_b * scaling)  # vLLM's own in-place multiply


@pytest.mark.parametrize("blob", [b"", b"not safetensors at all", adapter_blob({"x": torch.zeros(1)}, {})[:20],
                                  adapter_blob({"x": torch.zeros(1)}, {"r": 1})[:8] + b"{}"])
def test_a_blob_without_a_config_is_refused(blob):
    with pytest.raises(BlobError, match="adapter_config"):
        blob_config(blob)


def test_segments_are_private_and_only_graft_names_are_opened(tmp_path):
    shared = new_segment(b"\x01\x02\x03")
    try:
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, shared.segment)).st_mode) == 0o600
        mapped = map_segment(shared.segment)
    finally:
        shared.release()
    assert bytes(mapped) == b"\x01\x02\x03"  # a map outlives the name
    assert not os.path.exists(os.path.join(SHM_DIR, shared.segment))
    with pytest.raises(BlobError, match="no shared-memory segment"):
        map_segment(shared.segment)
    for bad in ("../etc/passwd", "graft-lora-xyz", str(tmp_path)):
        with pytest.raises(BlobError, match="not a graft shared-memory segment"):
            map_segment(bad)


def test_a_trainer_reuses_a_segment_only_once_its_version_is_released():
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    pool = SegmentPool()
    try:
        first, second = pool.write(1, tensors, {"v": 1}), pool.write(2, tensors, {"v": 2})
        assert first.segment != second.segment
        held = map_segment(second.segment)
        pool.release(1)
        third = pool.write(3, {"w": tensors["w"] + 10}, {"v": 3})  # same size: version 1's segment again
        assert third.segment == first.segment
        assert blob_config(held) == {"v": 2} and torch.equal(blob_tensors(held)["w"], tensors["w"])
        assert torch.equal(blob_tensors(map_segment(third.segment))["w"], tensors["w"] + 10)
    finally:
        pool.close()
    assert not os.path.exists(os.path.join(SHM_DIR, first.segment))
    assert not os.path.exists(os.path.join(SHM_DIR, second.segment))


def test_segments_of_a_killed_trainer_are_removed_by_the_next_one():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = os.path.join(SHM_DIR, f"graft-lora-{child.stdout.strip()}-{'0' * 16}")
    alive = os.path.join(SHM_DIR, f"graft-lora-{os.getpid()}-{'1' * 16}")
    for path in (dead, alive):
        with open(path, "wb") as segment:
            segment.write(b"x")
    try:
        SegmentPool().close()
        assert not os.path.exists(dead) and os.path.exists(alive)
    finally:
        for path in (dead, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_memory_paths_name_their_segment_and_no_directory_is_mistaken_for_one():
    segment = "graft-lora-123-" + "ab" * 8
    assert memory_segment(memory_path("/runs/a/weights/adapter-v000007.memory", segment)) == segment
    assert memory_segment("/runs/a/weights/adapter-v000007") is None
    assert memory_segment(f"/odd#dir/{segment}") is None and memory_segment(f"/x#{segment}/more") is None


# -- against the real server ------------------------------------------------------------------------

def _blob(base_dir, seed, rank=8, alpha=16, fold_scaling=False):
    model = trained_like_peft_model(base_dir, rank=rank, alpha=alpha, seed=seed)
    weights = policy_source(model).adapter()
    return adapter_blob(weights.tensors, weights.config, dtype=weights.dtype, fold_scaling=fold_scaling)


async def _served(client, name):
    """Greedy tokens and their log-probs for PROMPTS under adapter `name`, one request at a time: two
    requests in flight may share an engine step or not, which moves fp32 log-probs by an ulp
    (measured: 5e-7 in 2 of 4 runs), and this compares weights, not schedules."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=1)
    answers = [(await client.generate([GenerateRequest(prompt_token_ids=p, params=params)], adapter=name))[0][0]
               for p in PROMPTS]
    return [(a.token_ids, a.logprobs) for a in answers]


async def _staged(server):
    return await staged_labels(server.url)


@pytest.mark.vllm
def test_memory_loads_serve_exactly_what_the_disk_load_serves(vllm_server, base_dir, tmp_path):
    """Scaling 12/8: folded into lora_B by the trainer (a multiply that does not round to the same
    values as a power of two would) or by vLLM's optimize() at build, the served weights are bit-equal."""
    blob, folded = (_blob(base_dir, seed=3, alpha=12, fold_scaling=fold) for fold in (False, True))
    save_adapter(trained_like_peft_model(base_dir, rank=8, alpha=12, seed=3), tmp_path / "disk")
    names = ("disk", "mem-http", "mem-shm", "mem-folded")

    async def run():
        async with VllmClient(vllm_server.url) as client:
            await client.load_adapter("disk", str(tmp_path / "disk"))
            shared = new_segment(blob)
            try:
                await client.load_adapter_blob("mem-http", str(tmp_path / "label-http"), blob)
                await client.load_adapter_blob("mem-shm", str(tmp_path / "label-shm"), shared)
                await client.load_adapter_blob("mem-folded", str(tmp_path / "label-folded"), folded)
            finally:
                shared.release()
            try:
                served = {name: await _served(client, name) for name in names}
                paths = await client.adapter_paths()
                staged = await _staged(vllm_server)
            finally:
                for name in names:
                    await client.unload_adapter(name)
            return served, paths, staged, await _staged(vllm_server), shared

    served, paths, staged, after, shared = asyncio.run(run())
    assert all(served[name] == served["disk"] for name in names)
    assert memory_segment(paths["mem-shm"]) == shared.segment and not os.path.exists(paths["mem-shm"])
    assert paths["mem-shm"].startswith(str(tmp_path / "label-shm#"))
    assert staged == [sorted([paths["mem-http"], paths["mem-shm"], paths["mem-folded"]])]
    assert after == [[]]  # the unload dropped the blobs
    # Every segment this process made is unlinked (another graft process on the machine may hold its own).
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"graft-lora-{os.getpid()}-")]


@pytest.mark.vllm
def test_evictions_and_reloads_serve_the_first_load_bit_for_bit(vllm_server, base_dir, tmp_path):
    """Five adapters through the server's four CPU-cache slots, round-robin twice: in the second round
    every request finds its adapter evicted and rebuilt from the staged blob."""
    names = [f"evict-{i}" for i in range(vllm_server.config.max_loras + 1)]

    async def run():
        async with VllmClient(vllm_server.url) as client:
            for i, name in enumerate(names):
                await client.load_adapter_blob(name, str(tmp_path / name), _blob(base_dir, seed=10 + i))
            try:
                rounds = [[await _served(client, name) for name in names] for _ in range(3)]
            finally:
                for name in names:
                    await client.unload_adapter(name)
            return rounds

    first, *later = asyncio.run(run())
    assert all(round_ == first for round_ in later)
    assert len({str(answer) for answer in first}) == len(names)  # five different adapters, five answers


@pytest.mark.vllm
def test_a_bad_adapter_is_refused_by_vllms_own_checks_and_leaves_nothing(vllm_server, base_dir, tmp_path):
    too_wide = _blob(base_dir, seed=4, rank=16)  # the server's --max-lora-rank is 8
    weights = policy_source(trained_like_peft_model(base_dir, rank=8, seed=4)).adapter()
    foreign = adapter_blob({k.replace("q_proj", "conv_proj"): t for k, t in weights.converted().items()},
                           weights.config)

    async def run():
        async with VllmClient(vllm_server.url) as client:
            errors = []
            for adapter in (too_wide, foreign):  # vLLM answers 500 for these, from disk too
                with pytest.raises(EngineError) as error:
                    await client.load_adapter_blob("bad", str(tmp_path / "bad"), adapter)
                errors.append(str(error.value))
            with pytest.raises(EngineError, match="adapter_config"):
                await client._call("POST", "/v1/graft/load_lora_adapter", params={"lora_name": "b", "lora_path": "x"},
                                   content=b"junk")
            errors.append("")
            return errors, await client.list_adapters(), await _staged(vllm_server)

    errors, loaded, staged = asyncio.run(run())
    assert "greater than max_lora_rank" in errors[0] and "conv_proj" in errors[1]
    assert loaded == [] and staged == [[]]


@pytest.mark.vllm
def test_the_shm_transport_to_a_segment_the_server_cannot_see_is_unsupported(vllm_server):
    async def run():
        async with VllmClient(vllm_server.url) as client:
            await client.load_adapter_blob("far", "/nowhere/far", SharedBlob("graft-lora-1-" + "0" * 16, 8))

    with pytest.raises(TransportUnsupportedError, match="one host"):
        asyncio.run(run())


@pytest.mark.parametrize("status, body", [
    (404, {"detail": "Not Found"}),  # a vLLM not started by graft: no such route
    (501, {"error": {"message": "this server's workers cannot load adapters from memory", "code": 501}}),
])
def test_a_server_without_the_memory_route_says_so_as_unsupported(status, body):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers["content-type"], len(request.content)))
        return httpx.Response(status, json=body)

    async def run():
        async with VllmClient("http://vllm.test", transport=httpx.MockTransport(handler)) as client:
            await client.load_adapter_blob("a", "/label", adapter_blob({"w": torch.zeros(4)}, {"peft_type": "LORA"}))

    with pytest.raises(TransportUnsupportedError):
        asyncio.run(run())
    assert seen[0][:2] == ("/v1/graft/load_lora_adapter", "application/octet-stream") and seen[0][2] > 16
