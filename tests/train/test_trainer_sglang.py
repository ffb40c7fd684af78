"""Short `graft train` runs on SGLang (marked `sglang`; skipped without `make sglang-venv`): adapter
sync against the session's server at rollout.urls, merged sync against a server graft launches and
owns itself (rollout.engine sglang with no URLs)."""

import asyncio
import json

import pytest

from graft.config import load_config
from graft.rollout.sglang.client import SglangClient
from graft.rollout.sglang.launcher import sglang_missing
from graft.train.metrics import REQUIRED_KEYS
from graft.train.trainer import train

pytestmark = pytest.mark.sglang
SHORT_RUN = ["train.steps=2", "train.batch_prompts=2", "rollout.n_samples=4", "rollout.max_new_tokens=6",
             "lora.rank=8", "rollout.max_lora_rank=8", "train.eval_examples=4", "rollout.engine=sglang"]


def _assert_rows(run_dir, mode: str) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert set(REQUIRED_KEYS) <= row.keys() and row["sync_mode"] == mode
        assert row["logprob_abs_diff_max"] < 1e-3  # fp32 SGLang vs the fp32 trainer on the sampled tokens


def test_adapter_sync_run_against_a_running_sglang_server(sglang_server, base_dir, tmp_path):
    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{sglang_server.url}]",
                                "sync.mode=adapter", *SHORT_RUN])
    asyncio.run(train(config, tmp_path))
    _assert_rows(tmp_path, "adapter")

    async def probe():
        async with SglangClient(sglang_server.url) as client:
            return (await client.health()).healthy
    assert asyncio.run(probe())


def test_merged_sync_run_on_an_sglang_server_graft_launches(base_dir, tmp_path):
    if (missing := sglang_missing()) is not None:
        pytest.skip(missing)
    config = load_config(None, [f"model.path={base_dir}", "sync.mode=merged", *SHORT_RUN])
    asyncio.run(train(config, tmp_path))
    _assert_rows(tmp_path, "merged")
    logs = list((tmp_path / "logs").glob("sglang-*.log"))
    assert len(logs) == 1 and "fired up and ready to roll" in logs[0].read_text()


def test_text_prompts_and_stop_strings_on_sglang(sglang_server, base_dir, tmp_path):
    """data.prompt_format text on SGLang: prompts as plain text (no chat markup), the engine and the
    trainer score the same ids, and the stop strings end samples early."""
    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{sglang_server.url}]", *SHORT_RUN,
                                "data.prompt_format=text", 'data.prompt_template="Question: {prompt}\\nAnswer:"',
                                "data.stop=[' ', 'e']", "rollout.max_new_tokens=12"])
    asyncio.run(train(config, tmp_path))
    _assert_rows(tmp_path, "adapter")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # With a space and 'e' as stops, few of the 8 samples a step run to 12 tokens (without: all of them).
    assert all(r["truncated_fraction"] <= 0.5 and r["rollout_tokens"] < 8 * 12 / 2 for r in rows), rows
