"""Loading a run's config: one YAML file plus dotted command-line overrides, validated once.

A run is described by one YAML file plus dotted command-line overrides (`lora.rank=16`). Every
mistake a user can make here (unknown key, wrong type, out-of-range value, settings that cannot
work together) raises `ConfigError` before anything expensive starts, with one message that names
the full dotted key, e.g. `unknown config key 'lora.rnak' (in run.yaml)`.

Override values are parsed as YAML, so `16` is an int, `true` a bool, `[q_proj,v_proj]` a list
and `all-linear` a string. `key=` with nothing after `=` sets the key to null, as an empty YAML
value does (`key=''` gives the empty string). A section that is null in the file (all its keys
commented out) means that section's defaults.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from graft.atomic import atomic_write_text
from graft.config.schema import ConfigError, GraftConfig


def _dotted(loc: Sequence[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))


def _union_member(part: str | int) -> bool:
    """Whether `part`, the last of an error's location, names a member of a union type, as pydantic
    appends to each member's error (`int`, `constrained-int`, `literal['auto']`, `list[str]`): such
    errors are one mistake, which `_merged_unions` reports once."""
    return isinstance(part, str) and (part in ("int", "float", "bool", "str", "none") or "[" in part
                                      or part.startswith("constrained-"))


def _merged_unions(errors: list[dict]) -> list[dict]:
    """`errors` with the errors of each union-typed setting (one per member type the value is not)
    merged into one at the setting's own key: "Input should be greater than 0 or 'auto'"."""
    merged: list[dict] = []
    for err in errors:
        loc = err["loc"]
        if len(loc) < 2 or not _union_member(loc[-1]) or "error" in err.get("ctx", {}):
            merged.append(err)
            continue
        wanted = err["msg"].removeprefix("Input should be ").split(", unable to")[0]
        last = merged[-1] if merged else None
        if last is not None and last.get("union") and last["loc"] == loc[:-1] and last["input"] == err["input"]:
            last["msg"] += f" or {wanted}"
        else:
            merged.append({**err, "loc": loc[:-1], "msg": f"Input should be {wanted}", "union": True})
    return merged


def _format_errors(e: ValidationError, file: str | None, overrides: Sequence[str]) -> str:
    """One line per mistake (the member errors of a union-typed setting merged), pydantic boilerplate
    removed, each naming its full dotted key and where the value came from (an override, else the file)."""
    lines = []
    for err in _merged_unions(e.errors(include_url=False)):
        key = _dotted(err["loc"])
        cause = err.get("ctx", {}).get("error")
        if err["type"] == "extra_forbidden":
            line = f"unknown config key '{key}'"
        elif isinstance(cause, ConfigError):  # cross-field checks already name their keys
            line = str(cause)
        elif cause is not None:  # ValueError from a field validator
            line = f"{key}: {cause}"
        else:
            got = repr(err["input"])
            line = f"{key}: {err['msg']} (got {got if len(got) <= 60 else got[:57] + '...'})"
        keys = cause.keys if isinstance(cause, ConfigError) else (key,)
        lines.append(line + _origin(keys, file, overrides))
    return "\n".join(lines)


def _origin(keys: Sequence[str], file: str | None, overrides: Sequence[str]) -> str:
    """Where the values of `keys` came from: the overrides that set them (the last one per key
    wins) and/or the file; empty when neither (defaults only)."""
    used, from_file = [], False
    for key in keys:
        origin = next((o for o in reversed(overrides) if _override_covers(o, key)), None)
        if origin is None:
            from_file = True
        elif origin not in used:
            used.append(origin)
    parts = ["from override " + ", ".join(f"'{o}'" for o in used)] if used else []
    if from_file and file is not None:
        parts.append(f"in {file}")
    return f" ({'; '.join(parts)})" if parts else ""


def _override_covers(override: str, key: str) -> bool:
    okey = override.split("=", 1)[0].strip()
    return key == okey or key.startswith(okey + ".") or key.startswith(okey + "[")


def _apply_override(data: dict[str, Any], override: str) -> None:
    """Set `dotted.key=value` in the nested dict, creating missing sections on the way."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"bad override {override!r}: expected dotted.key=value, e.g. lora.rank=16")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {override!r}: value is not valid YAML ({e})") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            path = ".".join(parts[: i + 1])
            raise ConfigError(f"bad override {override!r}: '{path}' is {node[part]!r}, not a section of keys")
        node = node[part]
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> GraftConfig:
    """Build the run config from an optional YAML file, then dotted overrides (which win).

    Args:
        path: YAML file; None = defaults only.
        overrides: `dotted.key=value` strings; values parsed as YAML, `key=` sets null.

    Raises:
        ConfigError: missing/unparsable file, malformed override, unknown key, bad value, or
            settings that cannot work together.
    """
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"invalid YAML in {path}{where}: {problem}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if v is not None}  # `lora:` with nothing under it = defaults
    for override in overrides:
        _apply_override(data, override)
    try:
        return GraftConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, None if path is None else str(path), overrides)) from None


# What a literal rollout.api_key becomes in printed and saved YAML: null (pydantic's "**********" mask,
# reloaded, would be sent as the key), with a comment that one was set.
_API_KEY_LINE = "  api_key: null  # a key was set; graft never prints or saves it\n"


def config_to_yaml(cfg: GraftConfig) -> str:
    """The config as YAML, sections and keys in declaration order, every value explicit (a literal
    API key as null: see `_API_KEY_LINE`)."""
    data = cfg.model_dump(mode="json")
    key_set = data["rollout"].get("api_key") is not None
    data["rollout"]["api_key"] = None
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return text.replace("  api_key: null\n", _API_KEY_LINE, 1) if key_set else text


def save_config(cfg: GraftConfig, path: str | Path) -> None:
    """Write `cfg` as YAML atomically, so a crash never leaves a half-written config in a run dir."""
    atomic_write_text(path, config_to_yaml(cfg))


def resumed_config(run_dir: str | Path, path: str | Path | None, overrides: Sequence[str]) -> GraftConfig:
    """The config `graft train --resume` continues with: CONFIG where one is given, else the one the
    run being resumed saved (RUN_DIR/config.yaml, every value resolved), so that `graft train
    --run-dir D --resume [-o train.steps=40]` goes on as D was set, as verl and TRL runs resume from
    their own saved state; `-o` overrides apply on top either way.

    Raises:
        ConfigError: as `load_config`.
    """
    saved = Path(run_dir) / "config.yaml"
    return load_config(path if path is not None or not saved.is_file() else saved, overrides)


def changed_settings(before: GraftConfig, after: GraftConfig) -> list[str]:
    """`section.key: old -> new` for each setting `after` holds other than `before`, in declaration order."""
    old, new = before.model_dump(mode="json"), after.model_dump(mode="json")
    return [f"{section}.{key}: {old[section].get(key)!r} -> {value!r}"
            for section, keys in new.items() for key, value in keys.items() if old[section].get(key) != value]
