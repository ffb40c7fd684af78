"""A request's JSON fields, each read as the type it must be: `Fields`.

Every value a client sends is checked when it is read, and a wrong one is refused with one line
naming the field and what it must be (a 400), never a 500 from deep inside the service: a string
where a rank goes, a list where the sampling parameters go, a float seq_id, NaN as a learning rate.
"""

from __future__ import annotations

import math
from typing import Any

from graft.tenants.futures import RequestFailed

_MISSING = object()
INT64 = 1 << 63


class Fields:
    """The fields of a JSON object (`where` prefixes their names in errors, e.g. "sampling_params.")."""

    def __init__(self, data: Any, where: str = "") -> None:
        if not isinstance(data, dict):
            raise RequestFailed(f"{where.rstrip('.') or 'the request body'} must be a JSON object, got "
                                f"{_kind(data)}")
        self._data, self._where = data, where

    def __contains__(self, key: str) -> bool:
        return self._data.get(key) is not None

    def _get(self, key: str, default: Any) -> Any:
        value = self._data.get(key)
        if value is None:
            if default is _MISSING:
                raise RequestFailed(f"missing field '{self._where}{key}'")
            return default
        return value

    def _wrong(self, key: str, what: str, value: Any) -> RequestFailed:
        return RequestFailed(f"field '{self._where}{key}' must be {what}, got {_kind(value)}")

    def text(self, key: str, default: Any = _MISSING, *, max_length: int = 4096) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        if len(value) > max_length:
            raise RequestFailed(f"field '{self._where}{key}' is longer than {max_length} characters")
        return value

    def integer(self, key: str, default: Any = _MISSING, *, low: int = -INT64, high: int = INT64 - 1) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an integer", value)
        if not low <= value <= high:
            raise RequestFailed(f"field '{self._where}{key}' must be in {low}..{high}, got {value}")
        return value

    def number(self, key: str, default: Any = _MISSING, *, low: float = -math.inf, high: float = math.inf) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._wrong(key, "a finite number", value)
        if not low <= value <= high:
            raise RequestFailed(f"field '{self._where}{key}' must be in [{low}, {high}], got {value}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false", value)
        return value

    def object(self, key: str) -> Fields:
        """The object at `key` (missing or null: an empty one)."""
        return Fields(self._get(key, {}), f"{self._where}{key}.")

    def items(self, key: str) -> list:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise self._wrong(key, "a list", value)
        return value

    def raw(self, key: str) -> Any:
        """The value at `key` unchecked (None when missing), for a field of several allowed types."""
        return self._data.get(key)

    def keys(self) -> list[str]:
        return [key for key, value in self._data.items() if value is not None]


def _kind(value: Any) -> str:
    """A JSON value's kind, as a message names it (never the value itself: it may be huge)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)
