"""`graft bench verify` plumbing: the checks it times run against the session's real vLLM server (the
real run, quickstart runs with the check on and off plus the Qwen2.5-0.5B shape, takes ~5 minutes:
docs/benchmarks.md), and its flags are checked before anything starts."""

import argparse

import pytest

from graft.bench.verify_cost import SHAPE_CHECKS, run, shape_checks


@pytest.mark.vllm
def test_each_timed_check_follows_a_sync_and_passes(vllm_server, base_dir, tmp_path):
    import asyncio

    from graft.rollout.vllm.client import VllmClient

    seconds = asyncio.run(shape_checks(vllm_server.url, base_dir, tmp_path, rank=8))
    assert len(seconds) == SHAPE_CHECKS and all(s > 0 for s in seconds)

    async def graft_adapters():
        async with VllmClient(vllm_server.url) as client:
            return [name for name in await client.list_adapters() if name.startswith("bench-")]
    assert asyncio.run(graft_adapters()) == []  # the bench's sync left the server as it found it


def test_too_few_steps_to_measure_are_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="--steps must be above"):
        run(argparse.Namespace(steps=2, repeats=1, no_shape=True))
