"""Writes the small word-problem data set configs/byo-example.yaml trains on (written by graft, not
downloaded): GSM8K-shaped records with chat-message prompts, worked solutions ending "#### N", and a
`topic` field that rewards can read from `example.metadata`.

    python examples/make_word_problems.py        # rewrites the two files below, the same every time

- examples/word-problems-train.jsonl: 48 problems, one JSON object per line;
- examples/word-problems-eval.parquet: 16 more, as a Parquet table with the same columns.
"""

import json
import random
import sys
from pathlib import Path

ITEMS = [("apples", "shopping"), ("pencils", "school"), ("stickers", "school"), ("eggs", "shopping"),
         ("marbles", "games"), ("cards", "games"), ("stamps", "hobbies"), ("shells", "hobbies")]
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana"]


def problem(rng: random.Random) -> dict:
    """One two-step problem: a start amount, a gain, a loss."""
    item, topic = rng.choice(ITEMS)
    name = rng.choice(NAMES)
    start, gain = rng.randint(5, 60), rng.randint(2, 30)
    loss = rng.randint(1, start + gain - 1)
    after_gain, left = start + gain, start + gain - loss
    question = (f"{name} has {start} {item}. {name} gets {gain} more, then gives {loss} away. "
                f"How many {item} does {name} have now?")
    solution = (f"After getting more, {name} has {start} + {gain} = <<{start}+{gain}={after_gain}>>{after_gain} "
                f"{item}.\nAfter giving some away, {name} has {after_gain} - {loss} = "
                f"<<{after_gain}-{loss}={left}>>{left} {item}.\n#### {left}")
    return {"messages": [{"role": "user", "content": question}], "solution": solution, "topic": topic}


def write(out_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    records = [problem(rng) for _ in range(64)]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "word-problems-train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:48]))
    pq.write_table(pa.Table.from_pylist(records[48:]), out_dir / "word-problems-eval.parquet")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
