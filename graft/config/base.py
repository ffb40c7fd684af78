"""What every config section shares: the error type, the section base class, and the small checks
and constants the sections and their validators use."""

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A user mistake in the config; the message names the dotted key(s) at fault.

    `keys`: the dotted keys a cross-field check blames, so the message can also say where their
    values came from (an override or the file).
    """

    def __init__(self, message: str, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def auto_or_count(value: Any) -> Any:
    """`value` unchanged if it is "auto" or an integer >= 0 (the settings that are either); else ValueError."""
    if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"must be 'auto' or an integer >= 0 (got {value!r})")
    return value


def is_loopback_url(url: str) -> bool:
    """True when `url`'s host is this machine's loopback (a server graft may treat as local)."""
    return urlsplit(url).hostname in LOOPBACK_HOSTS


class Section(BaseModel):
    """Base of every config model: a misspelt key is an error, never silently ignored.

    No `__init__` override turns pydantic's ValidationError into ConfigError here: pydantic would
    then call it for nested sections and lose the key path. `load_config` does the conversion.
    """

    model_config = ConfigDict(extra="forbid")


ALL_LINEAR = "all-linear"


def module_list(value: Any, *, allow_all_linear: bool) -> str | list[str]:
    """Normalise a module-name setting: a plain string is ONE module name, never its characters.

    The one normaliser of module lists: config validation and `graft.lora.attach` both use it.

    Args:
        allow_all_linear: "all-linear" stays the string (every linear layer), and an empty list,
            which would adapt nothing, is refused.

    Raises:
        ValueError: not a string or a list/tuple of non-empty strings; an empty list of targets.
    """
    if isinstance(value, str):
        return value if allow_all_linear and value == ALL_LINEAR else [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"must be a module name or a list of module names (got {value!r})")
    if allow_all_linear and not value:
        raise ValueError(f"must not be an empty list (use {ALL_LINEAR!r} to adapt every linear layer)")
    return list(value)
