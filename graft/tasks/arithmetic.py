"""The built-in synthetic task "arithmetic": small integer sums a tiny model can learn in minutes.

Questions are drawn without replacement from every (a, op, b) with operands in [0, max_operand], so
the train and eval sets never share a question: eval accuracy measures generalisation, not recall.
"""

import random

from graft.tasks.examples import Example

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_task(
    seed: int = 0,
    n_train: int = 2000,
    n_eval: int = 1000,
    max_operand: int = 99,
    ops: tuple[str, ...] = ("+",),
) -> tuple[list[Example], list[Example]]:
    """Builds the (train, eval) sets, the same ones for the same arguments.

    Prompts read "What is 23 + 58? Answer with the number only." with answer "81"; metadata holds
    ``a``, ``op`` and ``b``.

    Args:
        seed: Seed of the draw.
        n_train: Number of training examples.
        n_eval: Number of eval examples; none of their (a, op, b) appears in training. Runs read
            the first `train.eval_examples` (200 by default); `graft bench learning` reads all
            1000 (a finer measure). 1000 and the 200 before it draw the same train set and
            the same first 200 (tests/tasks/test_arithmetic.py), so cached quickstart bases
            and earlier measurements stay valid.
        max_operand: Operands are integers in [0, max_operand].
        ops: Operators to draw from, a subset of "+", "-", "*".

    Raises:
        ValueError: For an unknown operator, a negative count or operand bound, or more examples
            than there are distinct questions.
    """
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {ops!r}")
    if n_train < 0 or n_eval < 0 or max_operand < 0:
        raise ValueError(f"n_train, n_eval and max_operand must be >= 0, got {n_train}, {n_eval}, {max_operand}")
    ops = tuple(dict.fromkeys(ops))  # duplicates would make two indices name one question
    n_values = max_operand + 1
    space = len(ops) * n_values * n_values
    if n_train + n_eval > space:
        raise ValueError(
            f"n_train + n_eval = {n_train + n_eval} exceeds the {space} distinct questions "
            f"for ops={ops!r}, max_operand={max_operand}"
        )
    # Sampling indices without replacement is what makes train and eval disjoint.
    indices = random.Random(seed).sample(range(space), n_train + n_eval)
    examples = [_example(i, ops, n_values) for i in indices]
    return examples[:n_train], examples[n_train:]


def _example(index: int, ops: tuple[str, ...], n_values: int) -> Example:
    op_index, rest = divmod(index, n_values * n_values)
    a, b = divmod(rest, n_values)
    op = ops[op_index]
    return Example(
        prompt=f"What is {a} {op} {b}? Answer with the number only.",
        answer=str(_OPS[op](a, b)),
        metadata={"a": a, "op": op, "b": b},
    )
