import asyncio

import pytest
import torch

from graft.bench.common import prepare_adapter_and_merged
from graft.bench.rollout import measure_rollout
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.vllm.client import VllmClient


async def _greedy_and_adapters(url: str) -> tuple[list[tuple[int, ...]], list[str]]:
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    async with VllmClient(url) as client:
        completions_P = await client.generate([GenerateRequest((5, 6, 7, 8), params)])
        return [c.token_ids for c in completions_P[0]], await client.list_adapters()


@pytest.mark.vllm
def test_rollout_bench_measures_three_modes_and_leaves_server_as_found(vllm_server, base_dir, tmp_path):
    before = asyncio.run(_greedy_and_adapters(vllm_server.url))
    adapter, merged = prepare_adapter_and_merged(base_dir, tmp_path, rank=8, dtype=torch.float32)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0, ignore_eos=True)
    requests = [GenerateRequest((3, 4, 5, 6), params), GenerateRequest((9, 10, 11), params)]
    rates = asyncio.run(measure_rollout(vllm_server.url, base_dir, adapter, merged, requests, repeats=2))
    assert set(rates) == {"base", "adapter", "merged"}
    assert all(len(values) == 2 and min(values) > 0 for values in rates.values())
    assert asyncio.run(_greedy_and_adapters(vllm_server.url)) == before
    assert before[1] == []
