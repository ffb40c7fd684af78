"""The run's rewards from its config: built-in names, ``package.module:function`` and
``path/to/file.py:function``, resolved and their signatures checked when a run loads its task,
before any engine starts.

The calling convention (one rule, from the parameter names):

- ``fn(completion: str, example: Example) -> float`` is called once per completion;
- a function whose first parameter is named ``completions`` is batched:
  ``fn(completions: list[str], examples: list[Example]) -> list[float]``, called once per batch
  (TRL's reward functions take ``completions`` by that name too; ``example.prompt``,
  ``example.answer`` and ``example.metadata`` hold what TRL passes as ``prompts`` and dataset columns);
- either may be ``async def``: graft awaits it (see `graft.tasks.scoring`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from graft.config import DataConfig
from graft.tasks.rewards import REWARDS
from graft.tasks.scoring import RewardTerm, Scorer

SIGNATURES = ("fn(completion: str, example: Example) -> float, or batched fn(completions: list[str], "
              "examples: list[Example]) -> list[float] (first parameter named 'completions'); either may be async")

_FILE_MODULES: dict[Path, ModuleType] = {}  # a file named by two rewards runs once


def load_scorer(data_config: DataConfig) -> Scorer:
    """The `Scorer` of data.reward or data.rewards, with data.reward_errors.

    Raises:
        ValueError: Naming the config key: an unknown built-in name, a module or file that does not
            import, a missing function, or a function with another signature.
    """
    specs = data_config.reward_specs()
    terms = []
    for i, spec in enumerate(specs):
        key = f"data.rewards[{i}].name" if data_config.rewards else "data.reward"
        fn, batched = resolve_reward(spec.name, key)
        terms.append(RewardTerm(spec.name, fn, spec.weight, batched))
    return Scorer(terms, on_error=data_config.reward_errors)


def load_eval_scorer(data_config: DataConfig) -> Scorer:
    """The `Scorer` of held-out evaluations: data.eval_reward alone, else the training rewards.

    Raises:
        ValueError: As `load_scorer`.
    """
    if data_config.eval_reward is None:
        return load_scorer(data_config)
    fn, batched = resolve_reward(data_config.eval_reward, "data.eval_reward")
    return Scorer([RewardTerm(data_config.eval_reward, fn, 1.0, batched)], on_error=data_config.reward_errors)


def resolve_reward(name: str, key: str = "data.reward") -> tuple[Callable[..., Any], bool]:
    """The function a reward name refers to, and whether it is batched.

    Args:
        name: A built-in name, ``package.module:function`` (imported; the package must be installed
            or on PYTHONPATH) or ``path/to/file.py:function`` (run as a module of its own, once,
            with its directory appended to sys.path; the path is relative to the current directory).
        key: The config key `name` came from, for error messages.

    Raises:
        ValueError: As `load_scorer`.
    """
    if ":" not in name:
        if name not in REWARDS:
            raise ValueError(f"{key}: unknown reward {name!r}; built-in rewards: {sorted(REWARDS)}; a function of "
                             "your own is 'package.module:function' or 'path/to/file.py:function'")
        return REWARDS[name], False
    fn = import_attribute(name, key, "function", "functions", inspect.isfunction)
    if not callable(fn):
        raise ValueError(f"{key}: {name} is a {type(fn).__name__}, not a function")
    return fn, _batched(fn, name, key)


def import_attribute(name: str, key: str, what: str, listed_as: str, is_listed: Callable[[Any], bool]) -> Any:
    """What a ``target:attr`` reference names (`import_target`); when the module has no `attr`, an
    error naming the `what` looked for and listing the module's public members that `is_listed`."""
    target, _, attr = name.rpartition(":")
    module = import_target(target, key)
    value = getattr(module, attr, None)
    if value is None:
        members = sorted(n for n, v in vars(module).items() if is_listed(v) and not n.startswith("_"))
        raise ValueError(f"{key}: {target} has no {what} {attr!r} (its {listed_as}: {members})")
    return value


def import_target(target: str, key: str) -> ModuleType:
    """The module of a ``target:name`` reference: ``package.module`` imported, or ``path/to/file.py``
    run once as a module of its own (see `resolve_reward`); user environments load the same way.

    Raises:
        ValueError: Naming `key`: the module or file does not import, or running it failed.
    """
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    return _load_file(Path(target), key) if is_file else _import_module(target, key)


def _import_module(target: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        as_file = Path(*target.split(".")).with_suffix(".py")
        hint = (f"; for the file in this directory write '{as_file}:function'" if as_file.is_file() else
                "; is it installed or on PYTHONPATH? A file is named as 'path/to/file.py:function'")
        raise ValueError(f"{key}: cannot import {target!r} ({error}){hint}") from None
    except Exception as error:  # the module itself failed: show where
        raise ValueError(f"{key}: importing {target!r} failed: {_traceback_tail(error)}") from None


def _load_file(path: Path, key: str) -> ModuleType:
    resolved = path.resolve()
    if resolved in _FILE_MODULES:
        return _FILE_MODULES[resolved]
    if not resolved.is_file():
        raise ValueError(f"{key}: file {path} does not exist (relative paths start at the current "
                         f"directory, {Path.cwd()})")
    # As for a script, modules beside the file are importable (appended: installed packages still win).
    if str(resolved.parent) not in sys.path:
        sys.path.append(str(resolved.parent))
    module_name = f"graft_reward_file_{len(_FILE_MODULES)}_{resolved.stem}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ValueError(f"{key}: running {path} failed: {_traceback_tail(error)}") from None
    _FILE_MODULES[resolved] = module
    return module


def _batched(fn: Callable[..., Any], name: str, key: str) -> bool:
    """Whether `fn` is batched (first parameter named 'completions'); checks it takes two arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some built-in callables have none: trust them
        return False
    names = list(signature.parameters)
    batched = bool(names) and names[0] == "completions"
    try:
        signature.bind(None, None)
        wrong = "completions" in names and not batched
    except TypeError:
        wrong = True
    if wrong:
        trl = ("; TRL's fn(prompts, completions, **kwargs) becomes fn(completions, examples), with "
               "examples[i].prompt, .answer and .metadata[column]") if "completions" in names else ""
        raise ValueError(f"{key}: reward {name!r} has the signature {signature}; graft calls {SIGNATURES}{trl}")
    return batched


def _traceback_tail(error: Exception) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__)  # the user's frames, not importlib's or ours
              if f.filename != __file__ and not f.filename.startswith("<frozen")][-3:]
    shown = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(error))
    return f"{type(error).__name__}: {error}\n{shown.rstrip()}"
