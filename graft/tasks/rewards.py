"""Rewards: functions of (completion text, example) -> float, looked up by name from `data.reward`.

Number reading (shared by every reward here): a number is an optionally signed integer, with
optional thousands separators ("1,234" reads 1234, but only in groups of three: "81,82" is two
numbers) and an optional decimal part ("81.5" reads 81.5, so it is not mistaken for 5; a trailing
"81." is 81 followed by a full stop). A sign counts only when it does not follow a letter or digit,
so "10-5" reads 10 and 5, not 10 and -5. Words ("eighty-one") are not numbers. Values compare
exactly (as fractions), so "81.0" equals "81".
"""

import re
from collections.abc import Callable
from fractions import Fraction

from graft.tasks.examples import Example

RewardFn = Callable[[str, Example], float]

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
# Not after a word character or a point: keeps "x2", "1.5"'s "5" and "10-5"'s "-5" from reading as numbers.
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])" + _NUMBER)
_ONLY_A_NUMBER = re.compile(r"\s*" + _NUMBER + r"\s*")


def _value(number: str) -> Fraction:
    return Fraction(number.replace(",", ""))


def _answer_value(example: Example) -> Fraction:
    if not _ONLY_A_NUMBER.fullmatch(example.answer):
        raise ValueError(f"answer {example.answer!r} is not a number; a numeric reward cannot score it")
    return _value(example.answer.strip())


def exact_numeric(completion: str, example: Example) -> float:
    """1.0 if the last number in the completion equals the answer, else 0.0 (also with no number).

    The last number, because a model that works step by step states its result at the end.

    Raises:
        ValueError: If the example's answer is not a number.
    """
    target = _answer_value(example)
    numbers = _NUMBER_IN_TEXT.findall(completion)
    if not numbers:
        return 0.0
    return float(_value(numbers[-1]) == target)


def format_reward(completion: str, example: Example) -> float:
    """1.0 if the completion is exactly one number, optionally surrounded by whitespace, else 0.0.

    Rewards following "Answer with the number only", right or wrong.
    """
    return float(_ONLY_A_NUMBER.fullmatch(completion) is not None)


def exact_numeric_and_format(completion: str, example: Example) -> float:
    """0.9 * exact_numeric + 0.1 * format: shaped so a bare wrong number beats rambling, while any
    correct answer beats any wrong one."""
    return 0.9 * exact_numeric(completion, example) + 0.1 * format_reward(completion, example)


REWARDS: dict[str, RewardFn] = {
    "exact_numeric": exact_numeric,
    "format": format_reward,
    "exact_numeric+format": exact_numeric_and_format,
}


def get_reward(name: str) -> RewardFn:
    """The reward registered under `name`.

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
    return REWARDS[name]
