"""graft.tasks.arithmetic: the built-in arithmetic task (CPU, seconds)."""

import pytest

from graft.tasks import TASKS, Example
from graft.tasks.arithmetic import arithmetic_task


def _key(ex: Example) -> tuple:
    return (ex.metadata["a"], ex.metadata["op"], ex.metadata["b"])


def test_arithmetic_prompt_and_answer():
    train, _ = arithmetic_task(seed=0, n_train=50, n_eval=5)
    for ex in train:
        a, op, b = _key(ex)
        assert op == "+"
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert ex.prompt == f"What is {a} + {b}? Answer with the number only."
        assert ex.answer == str(a + b)


def test_arithmetic_other_ops():
    train, _ = arithmetic_task(n_train=150, n_eval=0, max_operand=9, ops=("-", "*"))
    assert {ex.metadata["op"] for ex in train} == {"-", "*"}
    for ex in train:
        a, op, b = _key(ex)
        assert ex.answer == str(a - b if op == "-" else a * b)


def test_arithmetic_deterministic_per_seed():
    assert arithmetic_task(seed=3) == arithmetic_task(seed=3)
    assert arithmetic_task(seed=3)[0] != arithmetic_task(seed=4)[0]


def test_arithmetic_sizes_and_disjoint():
    train, held_out = arithmetic_task(seed=0, n_train=2000, n_eval=200)
    assert (len(train), len(held_out)) == (2000, 200)
    train_keys = {_key(ex) for ex in train}
    assert len(train_keys) == 2000  # no duplicates within train either
    assert train_keys.isdisjoint({_key(ex) for ex in held_out})


def test_arithmetic_can_use_the_whole_space():
    # 2 ops x 3 x 3 operands = 18 questions: all of them, each exactly once.
    train, held_out = arithmetic_task(n_train=14, n_eval=4, max_operand=2, ops=("+", "*"))
    assert len({_key(ex) for ex in train + held_out}) == 18


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_train": 90, "n_eval": 11, "max_operand": 9}, "exceeds the 100 distinct"),
        ({"ops": ("/",)}, "ops must be"),
        ({"ops": ()}, "ops must be"),
        ({"n_eval": -1}, ">= 0"),
    ],
)
def test_arithmetic_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        arithmetic_task(**kwargs)


def test_arithmetic_is_registered():
    assert TASKS["arithmetic"] is arithmetic_task


def test_the_default_1000_held_out_extend_the_200_the_quickstart_base_was_built_beside():
    """The warm-up draws (2000, 200); the default draws 1000 held-out: the same train set (so the cached
    bases never saw a held-out sum) and the same first 200 (what runs evaluate by default)."""
    train, held_out = arithmetic_task()
    train_200, held_out_200 = arithmetic_task(n_train=2000, n_eval=200)
    assert len(held_out) == 1000 and train == train_200 and held_out[:200] == held_out_200
    assert not {_key(ex) for ex in train} & {_key(ex) for ex in held_out}
