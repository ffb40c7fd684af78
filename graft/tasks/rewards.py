"""Built-in rewards: functions of (completion text, example) -> float, looked up by name from
`data.reward` / `data.rewards` (which also take user functions: `graft.tasks.reward_loading`).

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


# \boxed{ or \fbox{, the opening brace included.
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_VALUE = re.compile(r"(?<![\w.])(" + _NUMBER + r")(?:\s*/\s*(" + _NUMBER + r"))?")
# Dollar signs, percent signs, LaTeX thin spaces and {,} thousands separators say nothing about the value.
_NOISE = re.compile(r"\\?\$|\\?%|\\[,!;: ]|\{,\}")


def _boxed(text: str) -> str | None:
    """The contents of the last closed \\boxed{...} in `text` (nested braces kept), or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[match.end():i]
    return None


def _clean(text: str) -> str:
    text = _FRAC.sub(r"\1/\2", text.replace("\u2212", "-"))
    return _NOISE.sub("", text)


def _values(text: str) -> list[Fraction]:
    """The numbers of `text` in order, fractions where written a/b (or \\frac{a}{b})."""
    values = []
    for numerator, denominator in _VALUE.findall(_clean(text)):
        if not denominator:
            values.append(_value(numerator))
        elif _value(denominator) != 0:
            values.append(_value(numerator) / _value(denominator))
    return values


def final_answer(text: str) -> Fraction | None:
    """The value a math solution ends with, read as GSM8K and MATH write it: the first number in the
    last \\boxed{...}; else the first number after the last '####' ("#### 72 apples" is 72); else
    the last number of the text. None when there is no number there.

    A number may be written a/b or \\frac{a}{b}; "$", "%" and LaTeX spacing are ignored.
    """
    boxed = _boxed(text)
    if boxed is not None:
        return next(iter(_values(boxed)), None)
    if "####" in text:
        return next(iter(_values(text.rsplit("####", 1)[1])), None)
    return next(reversed(_values(text)), None)


def math_answer(completion: str, example: Example) -> float:
    """1.0 if the completion's final answer (see `final_answer`) equals the example's, else 0.0.

    The example's answer may be a number or a whole worked solution in GSM8K form
    ("... #### 72") or MATH form ("... \\boxed{72}"); values compare exactly, so "0.5" equals
    "1/2" and "\\frac{1}{2}".

    Raises:
        ValueError: If the example's answer holds no number.
    """
    target = final_answer(example.answer)
    if target is None:
        raise ValueError(f"answer {example.answer!r} holds no number; the math reward cannot score it")
    return float(final_answer(completion) == target)


REWARDS: dict[str, RewardFn] = {
    "exact_numeric": exact_numeric,
    "format": format_reward,
    "exact_numeric+format": exact_numeric_and_format,
    "math": math_answer,
}


def get_reward(name: str) -> RewardFn:
    """The reward registered under `name`.

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
    return REWARDS[name]
