"""Variants registered by name (aggregations, KL estimators, ratio levels, mismatch corrections):
one lookup, so every unknown name gets the same kind of error."""

from typing import TypeVar

T = TypeVar("T")


def lookup(registry: dict[str, T], name: str, what: str) -> T:
    """``registry[name]``.

    Raises:
        ValueError: If ``name`` is not registered; the message names ``what`` and lists the names.
    """
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; registered: {sorted(registry)}") from None
