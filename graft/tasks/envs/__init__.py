"""Environments of multi-turn episodes (`data.env`): the `Env` protocol, the built-in environments
(`calculator`, `guessing`, each with a task of the same name) and user environments by import path.

Importing the package registers the built-ins, so `ENVS` and `TASKS` are complete before anyone
looks a name up.
"""

from graft.tasks.envs import calculator, guessing  # noqa: F401  (register ENVS and TASKS entries)
from graft.tasks.envs.base import ENVS, Env, EnvFactory, StepResult
from graft.tasks.envs.loading import resolve_env

__all__ = ["ENVS", "Env", "EnvFactory", "StepResult", "resolve_env"]
