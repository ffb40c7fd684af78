"""The real vLLM engine and the in-process reference engine agree through the same protocol, and a
pool with a dead member reports it by address. Uses the session's shared vLLM server."""

import asyncio

import pytest

from graft.lora.adapter_io import save_adapter
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.launcher import free_port
from graft.rollout.pool import EnginePool, PoolBroadcastError
from graft.rollout.reference import ReferenceEngine
from graft.rollout.vllm.client import VllmClient
from tests.helpers import trained_like_peft_model

LOGPROB_ATOL = 1e-3
GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
# The 40-token prompt fills more than one 16-token KV block.
PROMPTS = [(5, 17, 200, 33, 9), (1, 2, 3), (400, 12, 99, 7, 7, 7), tuple(range(10, 50))]


async def _greedy_both(url: str, reference: ReferenceEngine, adapter: str | None):
    requests = [GenerateRequest(p, GREEDY) for p in PROMPTS]
    async with VllmClient(url) as client:
        served = await client.generate(requests, adapter=adapter)
    return served, await reference.generate(requests, adapter=adapter)


def _assert_agree(served, referenced) -> None:
    for (got,), (want,) in zip(served, referenced):
        assert len(got.token_ids) == 16
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= LOGPROB_ATOL


@pytest.mark.vllm
def test_vllm_and_reference_engine_agree_on_base_and_graft_adapter(vllm_server, base_dir, tmp_path):
    adapter_dir = save_adapter(trained_like_peft_model(base_dir), tmp_path / "adapter")
    reference = ReferenceEngine(base_dir)

    async def scenario():
        _assert_agree(*await _greedy_both(vllm_server.url, reference, None))
        await reference.load_adapter("policy-v1", str(adapter_dir))
        async with VllmClient(vllm_server.url) as client:
            await client.load_adapter("policy-v1", str(adapter_dir))
        try:
            served, referenced = await _greedy_both(vllm_server.url, reference, "policy-v1")
        finally:
            async with VllmClient(vllm_server.url) as client:
                await client.unload_adapter("policy-v1")
        _assert_agree(served, referenced)
        base_served, _ = await _greedy_both(vllm_server.url, reference, None)
        assert [c[0].token_ids for c in served] != [c[0].token_ids for c in base_served]

    asyncio.run(scenario())


@pytest.mark.vllm
def test_pool_with_a_dead_server_names_it_and_broadcasts_to_the_live_one(vllm_server, base_dir, tmp_path):
    adapter_dir = save_adapter(trained_like_peft_model(base_dir), tmp_path / "adapter")
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        live_client = VllmClient(vllm_server.url)
        # min_engines=2: no failover, so the broadcast fails (failover: test_pool_faults.py).
        pool = EnginePool([live_client, VllmClient(dead, connect_retries=0)], min_engines=2)
        try:
            health = {h.address: h.healthy for h in await pool.health_all()}
            assert health == {vllm_server.url: True, dead: False}
            assert not (await pool.health()).healthy
            with pytest.raises(PoolBroadcastError) as error:
                await pool.load_adapter("policy-v1", str(adapter_dir))
            assert dead in str(error.value) and "EngineUnreachableError" in str(error.value)
            assert error.value.succeeded == [vllm_server.url]
            # The live server did get the broadcast: the adapter is loaded and serves there.
            assert "policy-v1" in await live_client.list_adapters()
            completions = await live_client.generate([GenerateRequest((1, 2, 3), GREEDY)], adapter="policy-v1")
            assert len(completions[0][0].token_ids) == 16
        finally:
            await live_client.unload_adapter("policy-v1")
            await pool.aclose()

    asyncio.run(scenario())
