"""graft.tasks.scoring: weighted sums and per-reward metrics; per-completion, batched and async rewards;
what a failing reward does under data.reward_errors raise and zero (CPU, pure Python)."""

import asyncio
import logging
import math

import pytest

from graft.tasks import Example
from graft.tasks.rewards import exact_numeric
from graft.tasks.scoring import RewardError, RewardTerm, Scorer

EXAMPLES = [Example("What is 1 + 1?", "2"), Example([{"role": "user", "content": "What is 2 + 2?"}], "4"),
            Example("What is 3 + 3?", "6", {"unit": "apples"})]
COMPLETIONS = ["2", "It is 4.", "5 apples"]


def _score(scorer, completions=COMPLETIONS, examples=EXAMPLES):
    return asyncio.run(scorer(completions, examples))


def test_weighted_sum_and_one_mean_per_reward():
    def length(completions, examples):  # batched: the first parameter is named completions
        return [len(c) for c in completions]

    scorer = Scorer([RewardTerm("exact_numeric", exact_numeric, 1.0),
                     RewardTerm("length", length, -0.1, batched=True)])
    scores = _score(scorer)
    assert scores.rewards == pytest.approx([1 - 0.1, 1 - 0.8, 0 - 0.8])
    assert scores.metrics == pytest.approx({"reward/exact_numeric": 2 / 3, "reward/length": 17 / 3,
                                            "reward_errors": 0})


def test_rewards_read_the_examples_metadata():
    def unit(completion, example):
        return float(example.metadata.get("unit", "") in completion)

    assert _score(Scorer([RewardTerm("unit", unit)])).rewards == [1.0, 1.0, 1.0]  # "" is in every string


def test_async_rewards_run_concurrently_within_the_bound():
    running, most = 0, 0

    async def verify(completion, example):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        return float(completion == example.answer)

    scorer = Scorer([RewardTerm("verify", verify)], max_concurrency=4)
    scores = _score(scorer, ["2"] * 10, [EXAMPLES[0]] * 10)
    assert scores.rewards == [1.0] * 10 and most == 4


def test_async_batched_rewards_are_awaited():
    async def judge(completions, examples):
        await asyncio.sleep(0)
        return [float(c.startswith("It")) for c in completions]

    assert _score(Scorer([RewardTerm("judge", judge, batched=True)])).rewards == [0.0, 1.0, 0.0]


def _broken(completion, example):
    if completion.startswith("It"):
        return {"score": 1}[completion]  # KeyError, two frames below the reward
    return 1.0


def test_raise_names_the_reward_and_the_example_and_shows_the_traceback_tail():
    scorer = Scorer([RewardTerm("my_reward.py:broken", _broken)])
    with pytest.raises(RewardError) as info:
        _score(scorer)
    message = str(info.value)
    assert message.startswith("reward 'my_reward.py:broken' raised KeyError: 'It is 4.' on the example with "
                              "prompt 'What is 2 + 2?', answer '4', completion 'It is 4.'\nend of the reward's "
                              "traceback:\n")
    assert 'test_scoring.py", line' in message and "in _broken" in message
    assert 'return {"score": 1}[completion]' in message
    assert "scoring.py\", line" not in message.replace("test_scoring.py", "")  # graft's own frames left out
    assert "data.reward_errors: zero would score such completions 0" in message


def test_zero_scores_failures_0_counts_them_and_logs_the_first_once(caplog):
    scorer = Scorer([RewardTerm("broken", _broken), RewardTerm("exact_numeric", exact_numeric, 0.5)], on_error="zero")
    with caplog.at_level(logging.WARNING, logger="graft.tasks.scoring"):
        first = _score(scorer)
        second = _score(scorer)
    assert first.rewards == [1.0 + 0.5, 0.0 + 0.5, 1.0 + 0.0]
    assert first.metrics["reward_errors"] == second.metrics["reward_errors"] == 1
    assert first.metrics["reward/broken"] == pytest.approx(2 / 3)
    assert len(caplog.records) == 1 and "reward 'broken' raised KeyError" in caplog.records[0].getMessage()


@pytest.mark.parametrize("value, problem", [
    (None, r"returned None \(NoneType\), not a number"),
    ("1.0", r"returned '1.0' \(str\), not a number"),
    (math.nan, "returned nan, not a finite number"),
    (math.inf, "returned inf, not a finite number"),
])
def test_a_return_value_that_is_no_finite_number_is_an_error(value, problem):
    scorer = Scorer([RewardTerm("odd", lambda completion, example: value)])
    with pytest.raises(RewardError, match=rf"^reward 'odd' {problem} \(3 of 3 completions of the batch failed; "
                                          r"the first:\) on the example with prompt 'What is 1 \+ 1\?'"):
        _score(scorer)
    assert _score(Scorer(scorer.terms, on_error="zero")).metrics["reward_errors"] == 3


def test_booleans_and_numpy_scalars_are_numbers():
    import numpy as np

    scorer = Scorer([RewardTerm("bool", lambda c, ex: c == ex.answer), RewardTerm("np", lambda c, ex: np.float32(2))])
    assert _score(scorer).rewards == [3.0, 2.0, 2.0]


def test_a_batched_reward_that_fails_fails_the_whole_batch():
    def short(completions, examples):
        return [1.0] * (len(completions) - 1)

    with pytest.raises(RewardError, match=r"^reward 'short' returned 2 scores for 3 completions \(batched: all 3 "
                                          r"completions of the batch failed\) on the example with prompt 'What is 1"):
        _score(Scorer([RewardTerm("short", short, batched=True)]))

    def boom(completions, examples):
        raise ConnectionError("verifier down")

    scores = _score(Scorer([RewardTerm("boom", boom, batched=True), RewardTerm("exact", exact_numeric)], "zero"))
    assert scores.rewards == [1.0, 1.0, 0.0] and scores.metrics["reward_errors"] == 3
