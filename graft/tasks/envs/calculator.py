"""The built-in environment "calculator": multiplications too large to do in one's head, with a
calculator tool the model may call before answering.

A model turn that contains ``calc: <expression>`` (digits, + - * / and parentheses) is answered with
a ``tool`` message holding the value; any other turn is taken as the final answer, scored 1 when
its last number equals the product (`exact_numeric`), and ends the episode. A tool call costs
nothing, so a model that learns to call the tool and then copy its result does best; one that
answers at once must multiply in its head. The task `calculator` gives the examples: "What is
417 * 238?" with its answer.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from graft.tasks.envs.base import StepResult
from graft.tasks.examples import Example, prompt_messages
from graft.tasks.rewards import exact_numeric

_CALL = re.compile(r"calc:\s*([0-9+\-*/() .]+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
PROMPT = ("What is {a} * {b}? You may use a calculator: write 'calc: <expression>' and you will get the value. "
          "Then answer with the number only.")


def evaluate_expression(text: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / and parentheses, as text; an error
    message (never an exception) for anything else, as a real tool would answer."""
    try:
        return _format(_value(ast.parse(text.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as error:
        return f"error: {error}"


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only numbers, + - * / and parentheses")


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorEnv:
    """One episode: the question, then tool calls answered, until a turn without a call."""

    def reset(self, example: Example) -> list[dict]:
        self.example = example
        return prompt_messages(example)

    def step(self, model_text: str) -> StepResult:
        call = _CALL.search(model_text)
        if call is None:
            return StepResult(reward=exact_numeric(model_text, self.example), done=True)
        return StepResult(messages=[{"role": "tool", "content": evaluate_expression(call.group(1))}])


def calculator_task(seed: int = 0, n_train: int = 2000, n_eval: int = 200) -> tuple[list[Example], list[Example]]:
    """(train, eval) multiplications of two three-digit numbers, disjoint, the same per seed."""
    rng = random.Random(seed)
    pairs = list(dict.fromkeys((rng.randint(100, 999), rng.randint(100, 999)) for _ in range(3 * (n_train + n_eval))))
    examples = [Example(PROMPT.format(a=a, b=b), str(a * b), {"a": a, "b": b}) for a, b in pairs[:n_train + n_eval]]
    return examples[:n_train], examples[n_train:]
