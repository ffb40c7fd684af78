"""Multi-turn episodes, token in / token out: every model turn is a request of exactly the ids so far,
the sampled ids and the engine's log-probs are kept as sampled, environment turns are appended as the
chat template's suffix, the loss mask marks the model's ids only, and the limits cut and mark episodes."""

import asyncio
import contextlib

import pytest

from graft.models.loading import load_tokenizer
from graft.rollout.engine import SamplingParams
from graft.rollout.episodes import EpisodeLimits, TurnRenderer, run_episodes
from graft.rollout.reference import ReferenceEngine
from graft.tasks.envs import StepResult
from graft.tasks.examples import Example


class RecordingEngine:
    """The reference engine, recording each request's prompt ids and each answer."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, requests, adapter=None):
        answers = await self.engine.generate(requests, adapter)
        self.calls += [(r.prompt_token_ids, r.params, a[0]) for r, a in zip(requests, answers)]
        await asyncio.sleep(0)  # let other episodes run between turns, as a server would
        return answers


class Echo:
    """Replies to every turn with a tool message; done after `done_after` turns (None: never)."""

    def __init__(self, done_after=None):
        self.done_after, self.turns = done_after, 0

    def reset(self, example):
        return [{"role": "user", "content": example.prompt}]

    async def step(self, model_text):  # async on purpose: graft awaits it
        self.turns += 1
        if self.done_after is not None and self.turns >= self.done_after:
            return StepResult(reward=1.0 / self.turns, done=True)
        return [{"role": "tool", "content": f"turn {self.turns}"}], 0.25, False  # a plain tuple works too


@pytest.fixture(scope="module")
def engine_and_tokenizer(base_dir):
    return ReferenceEngine(base_dir), load_tokenizer(base_dir)


def _run(engine_and_tokenizer, env_factory, limits, n=3, max_new_tokens=5, seed=7, lease=None):
    engine, tokenizer = engine_and_tokenizer
    recording = RecordingEngine(engine)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    episodes = asyncio.run(run_episodes(recording, None, env_factory, [Example("Say hi.", "")] * n,
                                        TurnRenderer(tokenizer), params, limits, lease=lease))
    return episodes, recording.calls, tokenizer


def test_model_tokens_are_kept_as_sampled_and_environment_turns_are_template_suffixes(engine_and_tokenizer):
    episodes, calls, tokenizer = _run(engine_and_tokenizer, Echo, EpisodeLimits(max_turns=3))
    renderer = TurnRenderer(tokenizer)
    by_seed = {params.seed: (prompt_ids, completion) for prompt_ids, params, completion in calls}
    for e, episode in enumerate(episodes):
        ids, at, turns = episode.prompt_ids + episode.completion_ids, len(episode.prompt_ids), 0
        assert episode.prompt_ids == renderer.prompt_ids([{"role": "user", "content": "Say hi."}])
        while at < len(ids):
            # The turn's request is exactly the ids so far, and its answer sits next, unchanged.
            request, completion = by_seed[7 + e * 3 + turns]
            assert list(request) == ids[:at]
            n = len(completion.token_ids)
            assert ids[at:at + n] == list(completion.token_ids)
            assert episode.loss_mask[at - len(episode.prompt_ids):][:n] == [True] * n
            assert episode.logprobs[at - len(episode.prompt_ids):][:n] == list(completion.logprobs)
            at += n
            turns += 1
            if at == len(ids):
                break
            suffix = renderer.turn_ids([{"role": "tool", "content": f"turn {turns}"}], renderer.closes_turn(completion))
            assert ids[at:at + len(suffix)] == suffix
            start = at - len(episode.prompt_ids)
            assert episode.loss_mask[start:start + len(suffix)] == [False] * len(suffix)
            at += len(suffix)
        assert turns == episode.turns == 3 and episode.truncated  # no done: cut by max_turns
        assert episode.reward == pytest.approx(0.75)
        assert "<|im_start|>tool\nturn 2<|im_end|>\n<|im_start|>assistant\n" in tokenizer.decode(episode.completion_ids)


def test_done_ends_the_episode_unmarked_and_turn_seeds_differ(engine_and_tokenizer):
    episodes, calls, _ = _run(engine_and_tokenizer, lambda: Echo(done_after=2), EpisodeLimits(max_turns=5))
    assert [(e.turns, e.truncated, e.reward) for e in episodes] == [(2, False, 0.75)] * 3  # 0.25 + 1/2
    assert sorted(params.seed for _, params, _ in calls) == [7, 8, 12, 13, 17, 18]  # seed + episode * 5 + turn
    again, _, _ = _run(engine_and_tokenizer, lambda: Echo(done_after=2), EpisodeLimits(max_turns=5))
    assert [e.completion_ids for e in again] == [e.completion_ids for e in episodes]  # resume-exact


def test_the_token_limit_bounds_each_turn_and_cuts_the_episode(engine_and_tokenizer):
    prompt_len = len(TurnRenderer(engine_and_tokenizer[1]).prompt_ids([{"role": "user", "content": "Say hi."}]))
    limit = prompt_len + 20
    episodes, calls, _ = _run(engine_and_tokenizer, Echo, EpisodeLimits(max_turns=10, max_tokens=limit), n=2,
                              max_new_tokens=8)
    for prompt_ids, params, _ in calls:
        assert params.max_new_tokens == min(8, limit - len(prompt_ids))
    for episode in episodes:
        assert len(episode.prompt_ids) + len(episode.completion_ids) <= limit
        assert episode.truncated and episode.turns < 10
    with pytest.raises(ValueError, match="no room for a model turn under data.max_episode_tokens"):
        _run(engine_and_tokenizer, Echo, EpisodeLimits(max_turns=2, max_tokens=prompt_len), n=1)


def test_each_episode_holds_its_lease_for_all_its_turns(engine_and_tokenizer):
    held, seen = [0], []

    @contextlib.asynccontextmanager
    async def lease():
        held[0] += 1
        try:
            yield
        finally:
            held[0] -= 1

    class Watching(Echo):
        async def step(self, model_text):
            seen.append(held[0])
            return await super().step(model_text)

    episodes, _, _ = _run(engine_and_tokenizer, Watching, EpisodeLimits(max_turns=3), n=3, lease=lease)
    assert held[0] == 0 and len(seen) == 9 and min(seen) >= 1  # every turn ran under its episode's lease


def test_a_turn_cut_by_max_new_tokens_gets_the_close_of_its_turn_from_the_template(engine_and_tokenizer):
    tokenizer = engine_and_tokenizer[1]
    renderer = TurnRenderer(tokenizer)
    tool = [{"role": "tool", "content": "7"}]
    assert tokenizer.decode(renderer.turn_ids(tool, model_closed_turn=True)) == \
        "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(renderer.turn_ids(tool, model_closed_turn=False)) == \
        "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
