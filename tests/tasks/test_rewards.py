"""The rewards and their registry (CPU, pure Python)."""

import pytest

from graft.tasks import REWARDS, Example, get_reward
from graft.tasks.rewards import exact_numeric, exact_numeric_and_format, final_answer, format_reward, math_answer

EX_81 = Example("What is 23 + 58? Answer with the number only.", "81")

# completion -> (exact_numeric, format)
CASES = {
    "81": (1.0, 1.0),
    " 81\n": (1.0, 1.0),
    "The answer is 81.": (1.0, 0.0),
    "8 1": (0.0, 0.0),
    "-5": (0.0, 1.0),
    "81 or 82": (0.0, 0.0),  # the last number counts
    "82 or 81": (1.0, 0.0),
    "": (0.0, 0.0),
    "eighty-one": (0.0, 0.0),
    "81.0": (1.0, 1.0),  # equal numerically
    "81.5": (0.0, 1.0),  # not read as "5"
    "+81": (1.0, 1.0),
    "81\n\n82": (0.0, 0.0),
    "x81": (0.0, 0.0),  # part of a word, not a number
}


@pytest.mark.parametrize("completion", CASES)
def test_exact_numeric(completion):
    assert exact_numeric(completion, EX_81) == CASES[completion][0]


@pytest.mark.parametrize("completion", CASES)
def test_format(completion):
    assert format_reward(completion, EX_81) == CASES[completion][1]


@pytest.mark.parametrize("completion", CASES)
def test_shaped(completion):
    exact, fmt = CASES[completion]
    assert exact_numeric_and_format(completion, EX_81) == pytest.approx(0.9 * exact + 0.1 * fmt)


def test_negative_answer_and_sign_rules():
    ex = Example("What is 3 - 8?", "-5")
    assert exact_numeric("-5", ex) == 1.0
    assert exact_numeric("It is -5.", ex) == 1.0
    assert exact_numeric("5", ex) == 0.0
    assert exact_numeric("3-8 = -5", ex) == 1.0
    assert exact_numeric("10-5", Example("q", "5")) == 1.0  # "-" after a digit is an operator


def test_thousands_separators():
    ex = Example("q", "1234")
    assert exact_numeric("1,234", ex) == 1.0
    assert format_reward("1,234", ex) == 1.0
    assert exact_numeric("12,34", ex) == 0.0  # not groups of three: "12" and "34"
    assert exact_numeric("81,82", Example("q", "82")) == 1.0


def test_answer_must_be_numeric():
    with pytest.raises(ValueError, match="'eighty-one' is not a number"):
        exact_numeric("81", Example("q", "eighty-one"))


def test_registry_and_get_reward():
    assert set(REWARDS) == {"exact_numeric", "format", "exact_numeric+format", "math"}
    assert get_reward("math") is math_answer
    assert get_reward("exact_numeric") is exact_numeric
    assert get_reward("format") is format_reward
    assert get_reward("exact_numeric+format") is exact_numeric_and_format
    with pytest.raises(ValueError, match=r"unknown reward 'exact'.*'exact_numeric'.*'format'"):
        get_reward("exact")


def test_score():
    """Scoring a batch is one reward call per (completion, example) pair, as build_rollout_batch does."""
    examples = [EX_81, Example("q", "-5"), EX_81]
    shaped = get_reward("exact_numeric+format")
    assert [exact_numeric(c, ex) for c, ex in zip(["81", "-5", "80"], examples)] == [1.0, 1.0, 0.0]
    assert [shaped(c, ex) for c, ex in zip(["The answer is 81.", "-5", "no"], examples)] == pytest.approx(
        [0.9, 1.0, 0.0]
    )


# --- math: GSM8K- and MATH-style final answers ---------------------------------------------------

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Altogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72")


@pytest.mark.parametrize("completion, expected", [
    ("She sold 48 in April and 24 in May, 72 in all.\n#### 72", 1.0),
    ("48 + 24 = 72, so the answer is \\boxed{72}.", 1.0),
    ("\\boxed{72} clips (not 70)", 1.0),  # the boxed answer wins over a later number
    ("#### 72 clips", 1.0),  # the first number after ####
    ("#### 72.00", 1.0),
    ("#### $72", 1.0),
    ("She sold 24 in May, so 72 in all.", 1.0),  # no boxed or ####: the last number
    ("#### 70", 0.0),
    ("\\boxed{70}. Wait, 72.", 0.0),
    ("#### seventy-two", 0.0),
    ("", 0.0),
])
def test_math_reads_the_final_answer_of_the_completion(completion, expected):
    assert math_answer(completion, Example("How many clips?", GSM8K_ANSWER)) == expected


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{1/2}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{3}{4}}", "The answer is \\boxed{0.75}."),
    ("\\boxed{\\$1{,}000}", "1,000"),
    ("\\boxed{50\\%}", "#### 50"),
    ("#### \u22125", "-5"),  # a typeset minus sign
    ("\\boxed{\\boxed{7}}", "7"),  # nested braces are matched
])
def test_math_compares_values_however_they_are_written(completion, answer):
    assert math_answer(completion, Example("q", answer)) == 1.0


def test_math_answer_without_a_number_is_an_error():
    with pytest.raises(ValueError, match="holds no number"):
        math_answer("#### 4", Example("q", "four"))


def test_final_answer_of_an_unclosed_box_falls_back():
    assert final_answer("#### 12 then \\boxed{3") == 12  # a completion cut off inside the box
    assert final_answer("x \\boxed{") is None
    assert final_answer("3 and 1/0") == 3  # a fraction over zero is no value
