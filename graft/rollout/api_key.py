"""The inference servers' API key, in one place: where it is read from, how it is sent, how a
refusal is reported, and how a launched server gets it.

The key is read from the environment (or from `rollout.api_key`, a `SecretStr` that prints and
saves as stars) and goes only into the `Authorization: Bearer` header of each request and into the
environment of a server graft launches (vLLM reads `VLLM_API_KEY`), never onto a command line,
where `ps` would show it, and never into a message, a log or a saved config.

vLLM checks the key only on `/v1/*` routes: `/health` and the dev endpoints (`/pause`,
`/collective_rpc`, `/reset_prefix_cache`) stay open, which is why servers bind to loopback.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from graft.config import ConfigError, RolloutConfig
from graft.rollout.engine import BadRequestError

if TYPE_CHECKING:  # the launchers import this module; httpx is the clients' dependency
    import httpx

# The variable vLLM itself reads the key from (its `--api-key` would show the key in `ps`).
VLLM_KEY_ENV = "VLLM_API_KEY"


def resolve_api_key(rollout: RolloutConfig) -> str | None:
    """The servers' API key: `rollout.api_key`, else the environment variable `rollout.api_key_env`
    names (unset or empty: no key).

    Raises:
        ConfigError: `rollout.api_key_env` was set explicitly to a variable other than the default
            that is not set, which would otherwise surface later as the server's "Unauthorized". (A
            saved config, RUN_DIR/config.yaml, spells out the default: reloaded, it means no key.)
    """
    if rollout.api_key is not None:
        return rollout.api_key.get_secret_value() or None
    if rollout.api_key_env is None:
        return None
    key = os.environ.get(rollout.api_key_env)
    default = type(rollout).model_fields["api_key_env"].default
    if key is None and "api_key_env" in rollout.model_fields_set and rollout.api_key_env != default:
        raise ConfigError(f"rollout.api_key_env names the environment variable {rollout.api_key_env}, which is "
                          "not set", keys=("rollout.api_key_env",))
    return key or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that vLLM (`--api-key` / VLLM_API_KEY) and SGLang (`--api-key`) check; none
    without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def raise_if_unauthorized(response: httpx.Response, *, address: str, sent_key: bool) -> None:
    """One clear error for 401/403 instead of the server's bare "Unauthorized" (never the key).

    Raises:
        BadRequestError: The server wants an API key and got none, or not the one it expects.
    """
    if response.status_code not in (401, 403):
        return
    what = ("rejected the API key graft sent" if sent_key else
            "requires an API key and graft sent none")
    raise BadRequestError(f"{response.request.method} {response.request.url.path} -> HTTP {response.status_code}: "
                          f"the server {what}: put the server's key in the environment variable named by "
                          "rollout.api_key_env (default VLLM_API_KEY) or in rollout.api_key",
                          address=address, status=response.status_code)


def require_key_env(name: str | None) -> None:
    """Check, before a server starts, that the variable `name` (if any) holds a key.

    Raises:
        ValueError: `name` is unset or empty in the environment.
    """
    if name is not None and not os.environ.get(name):
        raise ValueError(f"the API key variable {name} is not set or empty in the environment")


def key_source(name: str | None) -> str | None:
    """Where a launched vLLM server's key comes from (`$NAME`), or None when it has none: `name`,
    else the `VLLM_API_KEY` it inherits."""
    if name is not None:
        return f"${name}"
    return f"${VLLM_KEY_ENV}" if os.environ.get(VLLM_KEY_ENV) else None


def server_key_env(name: str | None) -> dict[str, str]:
    """The environment entry that hands a launched vLLM server the key held in `name` (so it never
    shows in `ps`); empty without `name`, which keeps whatever `VLLM_API_KEY` the server inherits."""
    return {} if name is None else {VLLM_KEY_ENV: os.environ[name]}
