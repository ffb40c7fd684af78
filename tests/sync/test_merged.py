"""Merged sync against the session's real vLLM server (fp32 tiny qwen2).

Every test leaves the server serving the original base weights with no adapter loaded.
"""

import asyncio

import pytest
import torch

from graft.lora.attach import lora_parameters
from graft.rollout.reference import ReferenceEngine
from graft.rollout.vllm.client import VllmClient
from graft.sync.merged import MergedSync
from graft.sync.publish import WeightPublisher
from graft.sync.verify import verify_delivery
from tests.helpers import trained_like_peft_model
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
