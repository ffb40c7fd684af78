"""Who may use the Tinker service, and how much of it: `Users` (API keys) and `Limits`.

A user is a name with a key. Every session, model, sampling session, request and saved state the
service holds belongs to the user whose key made it, and a lookup outside that user's own set
answers exactly as a lookup of something that does not exist (graft.tenants.service). Keys come
from a file (`graft tenants serve --keys FILE`: `<user> <key>` per line, `#` comments) or, for one
user, from TINKER_API_KEY.

A key is compared with every known key in constant time (`hmac.compare_digest`, no early exit), so
the time of an answer tells nothing of how much of a guessed key was right; keys are never logged.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

KEY_PREFIX = "tml-"  # the tinker SDK refuses keys without it
SINGLE_USER = "default"  # the one user of a TINKER_API_KEY setup
_USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a path segment: states live under it


def check_api_key(key: str) -> str:
    if not key.startswith(KEY_PREFIX) or len(key) < 8 or any(c.isspace() for c in key):
        raise ValueError(f"an API key must start with {KEY_PREFIX!r}, be at least 8 characters and hold no "
                         f"spaces (the tinker SDK refuses others), got {key[:4]!r}...")
    return key


class Users:
    """API key -> user name; `user_of` finds a request's user."""

    def __init__(self, keys: dict[str, str]) -> None:
        if not keys:
            raise ValueError("no users: give at least one '<user> <key>' line")
        for user, key in keys.items():
            if not _USER_NAME.fullmatch(user):
                raise ValueError(f"user name {user!r}: use letters, digits, '_', '.', '-' (at most 64, "
                                 "starting with a letter or digit)")
            check_api_key(key)
        if len(set(keys.values())) != len(keys):
            raise ValueError("two users have the same key: each user needs a key of their own")
        self._keys = [(key.encode(), user) for user, key in keys.items()]
        self.names = sorted(keys)

    @classmethod
    def single(cls, key: str) -> Users:
        return cls({SINGLE_USER: key})

    @classmethod
    def from_file(cls, path: Path) -> Users:
        """The users of a keys file: one `<user> <key>` per line; blank lines and `#` comments skipped.

        Raises:
            ValueError: a malformed line (named by its number, never showing the key), a user named
                twice, a shared key, or no users.
        """
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"keys file {path}: {error.strerror or error}") from None
        keys: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 2:
                raise ValueError(f"keys file {path}, line {number}: expected '<user> <key>', got {len(fields)} "
                                 "fields")
            user, key = fields
            if user in keys:
                raise ValueError(f"keys file {path}, line {number}: user {user!r} is named twice")
            try:
                keys[user] = check_api_key(key)
            except ValueError as error:
                raise ValueError(f"keys file {path}, line {number}: {error}") from None
        return cls(keys)

    def user_of(self, key: str | None) -> str | None:
        """The user whose key `key` is; None for a missing or unknown key. Every known key is compared,
        each in constant time."""
        if not key:
            return None
        sent, found = key.encode(), None
        for known, user in self._keys:
            if hmac.compare_digest(sent, known):
                found = user
        return found


PASS_TOKENS = 4096  # padded tokens per forward pass (rows x longest row); more go in further passes


@dataclass(frozen=True)
class Limits:
    """What one user, one request or one datum may take of the service; each refusal names its
    limit (the flag that sets it). Defaults fit tinker-cookbook's recipes on one machine.

    Attributes:
        body_bytes: largest request body; larger ones are refused unread (413).
        datum_tokens: tokens in one datum (model_input + the last target); None: the base's context.
        request_tokens: tokens of all datums of one forward_backward (the whole pass a client asks for).
        sample_tokens: samples x max_tokens of one sample request.
        models_per_user: training models a user holds at once.
        sessions_per_user: live sessions a user holds at once.
        pending_per_user: a user's requests not yet finished (429 past it: the SDK backs off and retries).
        engine_per_user: a user's sample requests at the engine at once; more wait their turn.
    """

    body_bytes: int = 64 << 20
    datum_tokens: int | None = None
    request_tokens: int = 262_144
    sample_tokens: int = 65_536
    models_per_user: int = 8
    sessions_per_user: int = 16
    pending_per_user: int = 512
    engine_per_user: int = 32
