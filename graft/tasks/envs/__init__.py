"""Environments of multi-turn episodes (`data.env`): the `Env` protocol, the built-in environments
(`calculator`, `guessing`, each with a task of the same name) and user environments by import path.
The built-ins are listed by name in `ENVS` (`graft.tasks.envs.loading`).
"""

from graft.tasks.envs.base import Env, EnvFactory, StepResult
from graft.tasks.envs.loading import ENVS, resolve_env

__all__ = ["ENVS", "Env", "EnvFactory", "StepResult", "resolve_env"]
