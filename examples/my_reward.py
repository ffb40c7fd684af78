"""Rewards of your own, as graft loads them (configs/byo-example.yaml names them as
`examples/my_reward.py:<function>`, a path relative to the directory graft runs in).

The calling convention:
- `fn(completion, example) -> float` is called once per completion;
- a function whose first parameter is named `completions` is batched, `fn(completions, examples) ->
  list[float]`, called once per batch with every sample of every prompt (see `distinct_answers`);
- either may be `async def` (a verifier calling a service): graft awaits the calls concurrently.

`example` is a `graft.tasks.Example`: `.prompt` (a string, or chat messages `[{role, content}]`),
`.answer` (the reference answer as text), `.metadata` (every other field of the data record, e.g.
`topic` here). Raising, or returning anything but a finite number, stops the run with the example
and the end of the traceback, or with `data.reward_errors: zero` scores 0 and is counted.
"""

import re

_ANSWER_LINE = re.compile(r"#### -?\d+(?:\.\d+)?")


def answer_line(completion: str, example) -> float:
    """1.0 when the completion ends with a line '#### <number>', the form the system prompt asks for."""
    lines = completion.strip().splitlines()
    return float(bool(lines) and _ANSWER_LINE.fullmatch(lines[-1].strip()) is not None)


def distinct_answers(completions: list[str], examples: list) -> list[float]:
    """-1.0 for a completion that repeats an earlier sample of the same prompt word for word, else 0.0:
    only a batched reward sees the other samples of a prompt."""
    seen, scores = set(), []
    for completion, example in zip(completions, examples):
        key = (repr(example.prompt), completion.strip())
        scores.append(-1.0 if key in seen else 0.0)
        seen.add(key)
    return scores
