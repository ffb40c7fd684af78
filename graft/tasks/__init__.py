"""Tasks: the prompts a run trains and evaluates on, and the rewards that score completions.

Importing the package registers the built-in tasks, so `TASKS` is complete before anyone looks a
name up.
"""

from graft.tasks import arithmetic, envs  # noqa: F401  (register TASKS["arithmetic"], the environments' tasks)
from graft.tasks.examples import TASKS, Example, load_examples, load_task_data, prompt_messages, render_prompt_ids
from graft.tasks.reward_loading import load_eval_scorer, load_scorer, resolve_reward
from graft.tasks.rewards import REWARDS, RewardFn, get_reward
from graft.tasks.scoring import RewardError, RewardTerm, Scorer, Scores

__all__ = [
    "REWARDS",
    "TASKS",
    "Example",
    "RewardError",
    "RewardFn",
    "RewardTerm",
    "Scorer",
    "Scores",
    "get_reward",
    "load_eval_scorer",
    "load_examples",
    "load_scorer",
    "load_task_data",
    "prompt_messages",
    "render_prompt_ids",
    "resolve_reward",
]
