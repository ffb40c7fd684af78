"""Merged sync against the session's real vLLM server (fp32 tiny qwen2), and on a GPU against the
in-process reference engine.

Every test leaves the server serving the original base weights with no adapter loaded.
"""

import asyncio

import pytest
import torch

from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model
from graft.rollout.reference import ReferenceEngine
from graft.rollout.vllm.client import VllmClient
from graft.sync.guard import check_finite_policy
from graft.sync.merged import MergedSync
from graft.sync.publish import WeightPublisher
from graft.sync.source import ModelSource
from graft.sync.verify import DEFAULT_TOLERANCE, verify_delivery
from tests.helpers import randomize_lora, trained_like_peft_model
from tests.sync.common import FP32_TOLERANCE, greedy


def _base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}


@pytest.mark.vllm
def test_merged_sync_serves_the_merged_policy_and_never_touches_the_base(vllm_server, base_dir, tmp_path):
    model = trained_like_peft_model(base_dir)
    before = _base_weights(model)
    publisher = WeightPublisher(tmp_path / "weights", keep_versions=2)

    async def scenario():
        async with VllmClient(vllm_server.url) as client:
            base_tokens = await greedy(client)
            try:
                result = await MergedSync(client, publisher, dtype=torch.float32).sync(model, 1, 1)
                assert result.mode == "merged" and result.bytes > 0 and result.engine_adapters_loaded == 0
                served = await greedy(client)
                assert served == await greedy(ReferenceEngine(result_path(publisher, 1)))
                assert served != base_tokens
                gap = await verify_delivery(client, model, adapter=None, tolerance=FP32_TOLERANCE)
                assert gap <= FP32_TOLERANCE

                # 100 more merged syncs, each of a changed adapter: the trainer's base stays bit-identical.
                sync = MergedSync(client, publisher, dtype=torch.float32)
                for version in range(2, 102):
                    with torch.no_grad():
                        next(iter(lora_parameters(model).values())).add_(1e-3)
                    await sync.sync(model, version, version)
                assert all(torch.equal(before[n], p) for n, p in _base_weights(model).items())
                assert [v.version for v in publisher.versions("merged")] == [100, 101]
                assert await verify_delivery(client, model, adapter=None, tolerance=FP32_TOLERANCE) <= FP32_TOLERANCE
            finally:
                await client.reload_weights(str(base_dir))
            assert await greedy(client) == base_tokens

    asyncio.run(scenario())


def result_path(publisher, version):
    return next(v.path for v in publisher.versions("merged") if v.version == version)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_sync_of_a_cuda_policy_into_a_cuda_reference_engine(base_dir, tmp_path, dtype):
    """The trainer's policy on the GPU (a bf16 base keeps fp32 LoRA weights): merged on the GPU, written
    from CPU copies, reloaded by an engine on the GPU, and verified like any other sync."""
    model = attach_lora(load_model(base_dir, dtype=dtype), rank=8, alpha=16, seed=0)
    randomize_lora(model, 1)
    model.cuda()
    assert {p.dtype for p in lora_parameters(model).values()} == {torch.float32}
    before = _base_weights(model)
    publisher = WeightPublisher(tmp_path / "weights", keep_versions=2)
    engine = ReferenceEngine(base_dir, dtype=dtype, device="cuda")
    tolerance = DEFAULT_TOLERANCE[dtype]

    async def scenario():
        base_tokens = await greedy(engine)
        check_finite_policy(ModelSource(model), 1)
        result = await MergedSync(engine, publisher, dtype=getattr(torch, dtype)).sync(model, 1, 1)
        assert result.mode == "merged" and result.bytes > 0
        assert await greedy(engine) != base_tokens
        assert await verify_delivery(engine, model, adapter=None, tolerance=tolerance) <= tolerance
        assert all(torch.equal(before[n], p) for n, p in _base_weights(model).items())

    asyncio.run(scenario())
