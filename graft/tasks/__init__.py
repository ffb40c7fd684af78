"""Tasks: the prompts a run trains and evaluates on, and the rewards that score completions.

The built-in tasks are listed by name in `TASKS` (`graft.tasks.registry`), the built-in
environments in `graft.tasks.envs.ENVS`.
"""

from graft.tasks.examples import Example, load_examples, prompt_messages, render_prompt_ids
from graft.tasks.registry import TASKS, load_task_data
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
