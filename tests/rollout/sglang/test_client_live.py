"""`SglangClient` against the session's real SGLang server (marked `sglang`; skipped where `make
sglang-venv` has not run): the acceptance checks the vLLM client passes, on SGLang 0.5.23 serving
the tiny fp32 qwen2 on CPU with graft's CPU fixes (docs/sglang-cpu.md).

Every test leaves the server serving the base weights, with every adapter it loaded unloaded.
"""

import asyncio

import pytest
import torch

from graft.lora.adapter_io import save_adapter
from graft.models.loading import load_model
from graft.rollout.engine import AdapterAlreadyLoadedError, GenerateRequest, SamplingParams, UnknownAdapterError
from graft.rollout.reference import ReferenceEngine
from graft.rollout.sglang.client import SglangClient
from graft.sync.adapter import adapter_name
from graft.sync.merged import MergedSync
from graft.sync.publish import WeightPublisher
from graft.sync.verify import DeliveryError, verify_delivery
from tests.helpers import randomize_lora, trained_like_peft_model
from tests.sync.common import FP32_TOLERANCE, greedy, make_sync, run, served_version

LOGPROB_ATOL = 1e-3
GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
PROMPTS = [(5, 17, 200, 33, 9), (1, 2, 3), (400, 12, 99, 7, 7, 7), tuple(range(10, 50))]

pytestmark = pytest.mark.sglang


async def _greedy_both(client: SglangClient, reference: ReferenceEngine, adapter: str | None):
    requests = [GenerateRequest(p, GREEDY) for p in PROMPTS]
    return await client.generate(requests, adapter=adapter), await reference.generate(requests, adapter=adapter)


def _assert_agree(served, referenced) -> None:
    for (got,), (want,) in zip(served, referenced):
        assert len(got.token_ids) == 16 and got.finish_reason == "length"
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= LOGPROB_ATOL


def test_sglang_and_reference_engine_agree_greedily_on_base_and_adapter(sglang_server, base_dir, tmp_path):
    adapter_dir = save_adapter(trained_like_peft_model(base_dir), tmp_path / "adapter")
    reference = ReferenceEngine(base_dir)

    async def scenario():
        async with SglangClient(sglang_server.url) as client:
            _assert_agree(*await _greedy_both(client, reference, None))
            await reference.load_adapter("policy-v1", str(adapter_dir))
            await client.load_adapter("policy-v1", str(adapter_dir))
            try:
                served, referenced = await _greedy_both(client, reference, "policy-v1")
            finally:
                await client.unload_adapter("policy-v1")
            _assert_agree(served, referenced)
            base_served, _ = await _greedy_both(client, reference, None)
            assert [c[0].token_ids for c in served] != [c[0].token_ids for c in base_served]

    run(scenario())


def test_versioned_adapters_load_and_unload_with_sglangs_own_errors(sglang_server, base_dir, tmp_path):
    dirs = [save_adapter(trained_like_peft_model(base_dir, seed=s), tmp_path / f"a{s}") for s in (1, 2)]

    async def scenario():
        async with SglangClient(sglang_server.url) as client:
            await client.load_adapter("graft-v1", str(dirs[0]))
            await client.load_adapter("graft-v2", str(dirs[1]))
            try:
                assert await client.list_adapters() == ["graft-v1", "graft-v2"]
                with pytest.raises(AdapterAlreadyLoadedError, match="already loaded"):
                    await client.load_adapter("graft-v1", str(dirs[1]))
                with pytest.raises(UnknownAdapterError, match="never been loaded"):
                    await greedy(client, "graft-v9")
                one, two = await greedy(client, "graft-v1"), await greedy(client, "graft-v2")
                assert one != two
            finally:
                await client.unload_adapter("graft-v1")
            assert await client.list_adapters() == ["graft-v2"]
            with pytest.raises(UnknownAdapterError, match="does not exist"):
                await client.unload_adapter("graft-v1")
            # SGLang would silently re-load v1 from its old path; the client refuses to ask.
            with pytest.raises(UnknownAdapterError, match="was unloaded"):
                await greedy(client, "graft-v1")
            await client.unload_adapter("graft-v2")
            assert await client.list_adapters() == []

    run(scenario())


def test_log_probs_are_raw_not_temperature_scaled(sglang_server, base_dir):
    prompt = (5, 17, 200, 33, 9)
    params = SamplingParams(temperature=0.3, max_new_tokens=6, ignore_eos=True, seed=3)

    async def sample():
        async with SglangClient(sglang_server.url) as client:
            return (await client.generate([GenerateRequest(prompt, params)]))[0][0]

    got = run(sample())
    model = load_model(base_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1:-1].double()
    ids = torch.tensor(got.token_ids)[:, None]
    raw = torch.log_softmax(logits, -1).gather(1, ids)[:, 0]
    scaled = torch.log_softmax(logits / params.temperature, -1).gather(1, ids)[:, 0]
    assert torch.allclose(torch.tensor(got.logprobs, dtype=torch.float64), raw, atol=LOGPROB_ATOL)
    assert (torch.tensor(got.logprobs, dtype=torch.float64) - scaled).abs().max() > 10 * LOGPROB_ATOL


def test_verification_catches_a_wrong_adapter_and_stale_weights(sglang_server, base_dir, tmp_path):
    policy = trained_like_peft_model(base_dir, seed=1)
    impostor_dir = save_adapter(trained_like_peft_model(base_dir, seed=2), tmp_path / "impostor")
    policy_dir = save_adapter(policy, tmp_path / "policy")

    async def scenario():
        async with SglangClient(sglang_server.url) as client:
            with pytest.raises(DeliveryError, match="'graft-v7' is not loaded"):
                await verify_delivery(client, policy, adapter="graft-v7", tolerance=FP32_TOLERANCE)
            await client.load_adapter("graft-v7", str(impostor_dir))
            try:
                with pytest.raises(DeliveryError, match="differ from the trainer's") as error:
                    await verify_delivery(client, policy, adapter="graft-v7", tolerance=FP32_TOLERANCE)
                assert error.value.gap > 0.01
            finally:
                await client.unload_adapter("graft-v7")
            await client.load_adapter("graft-v8", str(policy_dir))
            try:
                assert await verify_delivery(client, policy, adapter="graft-v8", tolerance=FP32_TOLERANCE) <= 1e-4
            finally:
                await client.unload_adapter("graft-v8")
            with pytest.raises(DeliveryError):  # merged mode without the reload: still the base weights
                await verify_delivery(client, policy, adapter=None, tolerance=FP32_TOLERANCE)

    run(scenario())


def test_merged_reload_serves_the_merged_policy_and_flushes_the_prefix_cache(sglang_server, base_dir, tmp_path):
    model = trained_like_peft_model(base_dir)
    publisher = WeightPublisher(tmp_path / "weights", keep_versions=2)

    async def scenario():
        async with SglangClient(sglang_server.url) as client:
            base_tokens = await greedy(client)  # also fills SGLang's prefix cache with these prompts
            try:
                result = await MergedSync(client, publisher, dtype=torch.float32).sync(model, 1, 1)
                assert result.mode == "merged" and result.engine_adapters_loaded == 0
                merged_dir = next(v.path for v in publisher.versions("merged") if v.version == 1)
                served = await greedy(client)  # a stale cached prefix would give the base's tokens back
                assert served == await greedy(ReferenceEngine(merged_dir)) and served != base_tokens
                assert await verify_delivery(client, model, adapter=None, tolerance=FP32_TOLERANCE) <= FP32_TOLERANCE
            finally:
                await client.reload_weights(str(base_dir))
            assert await greedy(client) == base_tokens

    run(scenario())


def test_adapter_sync_cycles_with_concurrent_generation_keep_the_window(sglang_server, base_dir, tmp_path):
    cycles, keep, max_loras = 12, 3, 4
    model = trained_like_peft_model(base_dir, rank=8, seed=0)
    request = [GenerateRequest((5, 17, 200, 33, 9), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))]
    served: list[int] = []

    async def main():
        async with SglangClient(sglang_server.url) as client:
            sync, inflight, _ = make_sync(client, tmp_path, keep=keep, max_loras=max_loras, lora_name="accept",
                                          disk_keep=keep + 1)
            stop = asyncio.Event()

            async def generate_loop():
                while not stop.is_set():
                    if (version := sync.current_version) is None:
                        await asyncio.sleep(0.01)
                        continue
                    async with inflight.use(version):  # any error (an unloaded adapter) fails the test
                        await client.generate(request, adapter_name("accept", version))
                    served.append(version)

            loop = asyncio.create_task(generate_loop())
            try:
                for v in range(1, cycles + 1):
                    randomize_lora(model, seed=v)
                    result = await sync.sync(model, v, step=v)
                    assert result.unload_failures == 0
                    assert min(v, keep) <= result.engine_adapters_loaded <= min(min(v, keep) + 1, max_loras)
                    await served_version(served, v)
            finally:
                stop.set()
                await loop
                await sync.close()
            assert await client.list_adapters() == []

    run(main())
    assert len(served) >= cycles and len(set(served)) > cycles // 2


def test_an_idle_server_leaves_the_cores_alone(sglang_server):
    """--sleep-on-idle: without it SGLang's scheduler polls its sockets non-stop, and the suite's session
    server held 87% of one of 2 cores for the 49 minutes after its tests."""
    import os
    import subprocess
    import time

    def cpu_seconds() -> float:
        listing = subprocess.run(["ps", "-e", "-o", "pgid=,pid="], capture_output=True, text=True, check=True)
        pids = [pid for pgid, pid in (line.split() for line in listing.stdout.splitlines())
                if int(pgid) == sglang_server.pid]
        ticks = 0
        for pid in pids:
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
        return ticks / os.sysconf("SC_CLK_TCK")

    time.sleep(1.0)  # whatever the last test asked has ended
    before = cpu_seconds()
    time.sleep(3.0)
    assert cpu_seconds() - before < 0.6  # under a fifth of a core: polling would take ~2.6 s of the 3
