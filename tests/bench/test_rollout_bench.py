import argparse
import asyncio

import pytest
import torch

from graft.bench.common import prepare_adapter_and_merged
from graft.bench.rollout import add_arguments, by_adapter, measure_rollout, mixed_adapters
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.vllm.client import VllmClient


async def _greedy_and_adapters(url: str) -> tuple[list[tuple[int, ...]], list[str]]:
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    async with VllmClient(url) as client:
        completions_P = await client.generate([GenerateRequest((5, 6, 7, 8), params)])
        return [c.token_ids for c in completions_P[0]], await client.list_adapters()


def test_each_prompt_goes_to_one_adapter_in_turn():
    requests = [GenerateRequest((i,), SamplingParams()) for i in range(5)]
    batches = by_adapter(requests, ["a", "b"])
    assert {name: [r.prompt_token_ids for r in batch] for name, batch in batches.items()} == {
        "a": [(0,), (2,), (4,)], "b": [(1,), (3,)]}


def test_model_and_dtype_flags_choose_the_served_model_and_its_dtype():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert (parser.parse_args([]).model, parser.parse_args([]).dtype) == ("tiny", "bfloat16")
    assert parser.parse_args(["--model", "smollm2"]).model == "smollm2"
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"  # what the quickstarts serve
    for wrong in (["--model", "gpt2"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit):
            parser.parse_args(wrong)


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


@pytest.mark.vllm
def test_rollout_bench_measures_mixed_adapters_and_unloads_them(vllm_server, base_dir, tmp_path):
    adapter, merged = prepare_adapter_and_merged(base_dir, tmp_path, rank=8, dtype=torch.float32)
    mixed = mixed_adapters(base_dir, tmp_path, rank=8, count=2, dtype=torch.float32)
    assert len(set(path.read_bytes() for path in (p / "adapter_model.safetensors" for p in mixed))) == 2
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0, ignore_eos=True)
    requests = [GenerateRequest((3, 4, 5, 6), params), GenerateRequest((9, 10, 11), params)]
    rates = asyncio.run(measure_rollout(vllm_server.url, base_dir, adapter, merged, requests, repeats=1,
                                        mixed=mixed))
    assert set(rates) == {"base", "adapter", "mixed_adapters", "merged"}
    assert min(rates["mixed_adapters"]) > 0
    assert asyncio.run(_greedy_and_adapters(vllm_server.url))[1] == []
