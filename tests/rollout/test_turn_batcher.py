"""The turn batcher: every episode's turn request made in one event-loop pass reaches the engine in
one call, answers go back to their callers in order, adapters are never mixed, and an engine error
reaches every caller of its call."""

import asyncio

import pytest

from graft.models.tokenizer import train_tokenizer
from graft.rollout.engine import Completion, GenerateRequest, SamplingParams
from graft.rollout.episodes import EpisodeLimits, TurnRenderer, run_episodes
from graft.rollout.turn_batcher import TurnBatcher
from graft.tasks.envs.guessing import GuessingEnv, guessing_task

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=3)


class Counting:
    """Answers each request with its prompt's last id (and the adapter's name in the finish reason);
    records each call's adapter and size."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    async def generate(self, requests, adapter=None):
        self.calls.append((adapter, len(requests)))
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("engine down")
        return [[Completion((r.prompt_token_ids[-1],), [0.0], str(adapter))] for r in requests]


def request(last_id):
    return GenerateRequest((1, last_id), PARAMS)


def test_calls_in_one_pass_are_one_engine_call_per_adapter_with_answers_in_order():
    engine = Counting()

    async def main():
        batcher = TurnBatcher(engine)
        calls = [batcher.generate([request(i), request(100 + i)], "a" if i % 2 else None) for i in range(6)]
        return await asyncio.gather(*calls)

    answers = asyncio.run(main())
    assert sorted(engine.calls, key=str) == sorted([(None, 6), ("a", 6)], key=str)
    for i, pair in enumerate(answers):
        assert [c[0].token_ids for c in pair] == [(i,), (100 + i,)]
        assert {c[0].finish_reason for c in pair} == {str("a" if i % 2 else None)}


def test_an_engine_error_reaches_every_caller_of_the_call():
    async def main():
        batcher = TurnBatcher(Counting(fail=True))
        return await asyncio.gather(*(batcher.generate([request(i)]) for i in range(3)), return_exceptions=True)

    assert [str(e) for e in asyncio.run(main())] == ["engine down"] * 3


def test_a_cancelled_caller_does_not_disturb_the_others():
    async def main():
        batcher = TurnBatcher(Counting())
        first = asyncio.ensure_future(batcher.generate([request(1)]))
        second = asyncio.ensure_future(batcher.generate([request(2)]))
        await asyncio.sleep(0)
        first.cancel()
        return await second

    assert asyncio.run(main())[0][0].token_ids == (2,)


@pytest.mark.parametrize("episodes", [1, 12])
def test_each_turn_of_a_batch_of_episodes_is_one_engine_call(episodes):
    class Guessing:
        """Guesses 1, 2, 3, ... (a wrong guess gets a reply), recording each call's size."""

        def __init__(self, tokenizer):
            self.tokenizer, self.sizes = tokenizer, []

        async def generate(self, requests, adapter=None):
            self.sizes.append(len(requests))
            guess = len(self.sizes)
            ids = tuple(self.tokenizer.encode(str(guess))) + (self.tokenizer.eos_token_id,)
            return [[Completion(ids, [0.0] * len(ids), "stop")] for _ in requests]

    tokenizer = train_tokenizer()
    engine = Guessing(tokenizer)
    secrets = [ex for ex in guessing_task(seed=0)[0] if int(ex.answer) > 4][:episodes]
    result = asyncio.run(run_episodes(engine, None, GuessingEnv, secrets, TurnRenderer(tokenizer),
                                      PARAMS, EpisodeLimits(max_turns=4)))
    assert engine.sizes == [episodes] * 4 and all(e.turns == 4 and e.truncated for e in result)
