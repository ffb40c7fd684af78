"""The run's environment from its config (`data.env`): a built-in name, ``package.module:Class`` or
``path/to/file.py:Class``, resolved and its shape checked when a run loads its task, before any
engine starts, so a wrong name or signature is one error line naming the key.
"""

from __future__ import annotations

import inspect
from typing import Any

from graft.tasks.envs.base import ENV_SIGNATURES, EnvFactory
from graft.tasks.envs.calculator import CalculatorEnv
from graft.tasks.envs.guessing import GuessingEnv
from graft.tasks.reward_loading import import_attribute

_KEY = "data.env"

# The built-in environments by name, each with a task of the same name (`graft.tasks.registry.TASKS`).
ENVS: dict[str, EnvFactory] = {"calculator": CalculatorEnv, "guessing": GuessingEnv}


def resolve_env(name: str, key: str = _KEY) -> EnvFactory:
    """The environment class (or zero-argument factory) `name` refers to.

    Args:
        name: A built-in environment (`ENVS`), ``package.module:Class`` (imported; installed or on
            PYTHONPATH) or ``path/to/file.py:Class`` (relative to the current directory; modules
            beside the file are importable).
        key: The config key `name` came from, for error messages.

    Raises:
        ValueError: Naming `key`: an unknown built-in name, a module or file that does not import, a
            missing attribute, or something that cannot be called as graft calls an environment.
    """
    if ":" not in name:
        if name not in ENVS:
            raise ValueError(f"{key}: unknown environment {name!r}; built-in environments: {sorted(ENVS)}; one of "
                             "your own is 'package.module:Class' or 'path/to/file.py:Class'")
        return ENVS[name]
    factory = import_attribute(name, key, "class or function", "classes", inspect.isclass)
    _check_shape(factory, name, key)
    return factory


def _check_shape(factory: Any, name: str, key: str) -> None:
    """`factory()` must work and give an object with `reset(example)` and `step(model_text)`; a class is
    checked without making one, a factory function by calling it once."""
    problem = None
    if not callable(factory):
        problem = f"is not a class but a value of type {type(factory).__name__}"
    elif not _binds(factory):
        problem = f"cannot be called with no arguments (signature {_signature(factory)})"
    else:
        env = factory if inspect.isclass(factory) else factory()
        for method in ("reset", "step"):
            fn = getattr(env, method, None)
            # On a class the method is unbound: `self` takes the first of the two arguments.
            arity = 2 if inspect.isclass(env) and inspect.isfunction(fn) else 1
            if not callable(fn):
                problem = f"has no method {method}()"
            elif not _binds(fn, arity):
                problem = f"has {method}{_signature(fn)}, which does not take one argument"
            if problem:
                break
    if problem:
        raise ValueError(f"{key}: environment {name!r} {problem}; graft needs {ENV_SIGNATURES}")


def _binds(fn: Any, arity: int = 0) -> bool:
    try:
        inspect.signature(fn).bind(*[None] * arity)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some built-ins): trust it
        return True
    return True


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"
