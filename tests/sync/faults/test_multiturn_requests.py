"""Multi-turn rollouts that request the adapter on the first turn only (ART #661, ms-swift #9855: later
turns sampled from the base model while every metric looked normal) do not happen in graft's design:
an episode gets one adapter name and every model turn requests it (graft.rollout.episodes). Checked
here on the real vLLM server, by what was sent and by what was served: every turn's request names the
adapter, and every turn's engine log-probs are the adapter's, not the base model's."""

import asyncio

import pytest

from graft.lora.adapter_io import save_adapter
from graft.lora.attach import adapter_disabled
from graft.models.loading import load_tokenizer
from graft.rollout.engine import SamplingParams
from graft.rollout.episodes import EpisodeLimits, TurnRenderer, run_episodes
from graft.rollout.vllm import client as vllm_client
from graft.sync.source import ModelSource
from graft.tasks.examples import Example
from tests.helpers import trained_like_peft_model
from tests.rollout.test_episodes import Echo

TURNS = 3


def _largest_gap(episode, local) -> float:
    """The largest |engine - local| log-prob gap at the episode's model tokens."""
    return max(abs(a - b) for a, b, mine in zip(episode.logprobs, local, episode.loss_mask) if mine)


@pytest.mark.vllm
def test_every_turn_of_an_episode_is_sampled_from_the_adapter(vllm_server, base_dir, tmp_path, monkeypatch):
    policy = trained_like_peft_model(base_dir, rank=8, seed=5)
    adapter_dir = save_adapter(policy, tmp_path / "adapter")
    named = []
    payload = vllm_client.completion_payload
    monkeypatch.setattr(vllm_client, "completion_payload",
                        lambda request, model: named.append(model) or payload(request, model))
    params, renderer = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3), TurnRenderer(load_tokenizer(base_dir))

    async def episodes():
        async with vllm_client.VllmClient(vllm_server.url) as client:
            await client.load_adapter("turns-v1", str(adapter_dir))
            try:
                return await run_episodes(client, "turns-v1", Echo, [Example("Say hi.", "")] * 2, renderer, params,
                                          EpisodeLimits(max_turns=TURNS))
            finally:
                await client.unload_adapter("turns-v1")

    sampled = asyncio.run(episodes())
    assert [e.turns for e in sampled] == [TURNS, TURNS]
    assert len(named) >= TURNS and set(named) == {"turns-v1"}  # each turn's request, batched per turn
    source = ModelSource(policy)
    for episode in sampled:
        # The engine's log-probs of every model token, later turns included, are the adapter's...
        assert _largest_gap(episode, source.logprobs(episode.prompt_ids, episode.completion_ids)) < 1e-3
        with adapter_disabled(policy):  # ...and measurably not the base model's
            assert _largest_gap(episode, source.logprobs(episode.prompt_ids, episode.completion_ids)) > 1e-2
