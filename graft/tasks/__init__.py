"""Tasks: the prompts a run trains and evaluates on, and the rewards that score completions.

Importing the package registers the built-in tasks, so `TASKS` is complete before anyone looks a
name up.
"""

from graft.tasks import arithmetic  # noqa: F401  (registers TASKS["arithmetic"])
from graft.tasks.examples import TASKS, Example, load_jsonl, load_task_data, render_prompt_ids
from graft.tasks.rewards import REWARDS, RewardFn, get_reward

__all__ = [
    "REWARDS",
    "TASKS",
    "Example",
    "RewardFn",
    "get_reward",
    "load_jsonl",
    "load_task_data",
    "render_prompt_ids",
]
