import asyncio
import json

import pytest

from graft.config import load_config
from graft.train.metrics import REQUIRED_KEYS
from graft.train.trainer import train


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_grpo_run_on_the_reference_engine_writes_every_metric(base_dir, tmp_path, mode):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", f"sync.mode={mode}",
                                "train.steps=2", "train.batch_prompts=2", "rollout.n_samples=3",
                                "rollout.max_new_tokens=4", "train.kl_coef=0.01", "lora.rank=4",
                                "train.eval_examples=4"])
    result = asyncio.run(train(config, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert set(REQUIRED_KEYS) <= row.keys()
        assert row["sync_mode"] == mode and row["staleness_max"] == 0
        assert 0 < row["rollout_tokens"] <= 2 * 3 * 4  # max_new_tokens caps each sample; eos may stop one early
        assert row["logprob_abs_diff_max"] < 1e-3  # the reference engine computes what the trainer computes
        assert row["grad_norm"] >= 0 and row["kl"] >= 0
    assert row["engine_adapters_loaded"] == (2 if mode == "adapter" else 0)  # keep_versions auto = 2
    assert 0.0 <= result["accuracy_before"] <= 1.0 and 0.0 <= result["accuracy_after"] <= 1.0
    assert (tmp_path / "reward.png").stat().st_size > 0 and (tmp_path / "config.yaml").is_file()


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_grpo_run_against_the_real_vllm_server(vllm_server, base_dir, tmp_path, mode):
    from graft.rollout.vllm_client import VllmClient

    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]", f"sync.mode={mode}",
                                "train.steps=2", "train.batch_prompts=2", "rollout.n_samples=4",
                                "rollout.max_new_tokens=6", "lora.rank=8", "rollout.max_lora_rank=8",
                                "train.eval_examples=4"])
    try:
        asyncio.run(train(config, tmp_path))
    finally:
        async def restore():
            async with VllmClient(vllm_server.url) as client:
                await client.reload_weights(str(base_dir))
                return await client.list_adapters()
        assert asyncio.run(restore()) == []  # the run unloaded every adapter it loaded
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert set(REQUIRED_KEYS) <= row.keys() and row["sync_mode"] == mode
        assert row["logprob_abs_diff_max"] < 1e-3  # fp32 vLLM vs the fp32 trainer on the sampled tokens
