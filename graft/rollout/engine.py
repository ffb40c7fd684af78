"""The rollout engine protocol: the one interface the trainer and the sync code use to talk to an
inference server, whatever it is (vLLM over HTTP, SGLang over HTTP, the in-process reference).

Shapes: a request holds one prompt and asks for `n` samples; the engine answers with `n`
completions, each carrying the sampled token ids and the log-prob of each sampled token under the
policy that generated it (the engine's), so the trainer can compare with its own log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; `seed` makes sampling repeatable per request;
    `top_k` 0 keeps every token; a token of `stop_token_ids` ends a sample as end-of-sequence does."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1 "
                             f"(got n={self.n}, max_new_tokens={self.max_new_tokens})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {self.top_k}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1] (got {self.temperature}, {self.top_p})")


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt, as token ids (the trainer tokenizes once, so both sides see the same tokens)."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Completion:
    """One sample: the generated token ids, the log-prob of each under the engine's policy, and why
    it stopped ("stop" for eos/stop string, "length" for max_new_tokens)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str = ""

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one log-prob per sampled token"


@dataclass(frozen=True)
class EngineHealth:
    """What `health()` reports: where the engine is, whether it answers, and what it holds."""

    address: str
    healthy: bool
    adapters: tuple[str, ...] = ()
    detail: str = ""


class EngineError(RuntimeError):
    """An engine refused or failed a request; the message carries the server's own words."""

    def __init__(self, message: str, *, address: str = "", status: int | None = None) -> None:
        super().__init__(f"{address}: {message}" if address else message)
        self.address = address
        self.status = status
        self.server_message = message


class UnknownAdapterError(EngineError):
    """The adapter named in a request or an unload is not loaded on the engine."""


class AdapterAlreadyLoadedError(EngineError):
    """An adapter with this name is already loaded (versioned names make this a caller bug)."""


class EngineUnavailableError(EngineError):
    """The engine cannot be reached or is not serving (connection refused, timed out, 5xx)."""


class EngineUnreachableError(EngineUnavailableError):
    """Nothing answers at the engine's address any more (every connection attempt refused or timed out):
    the server is gone, not merely slow."""


class BadRequestError(EngineError):
    """The engine rejected the request as malformed (bad path, bad parameters)."""


class TransportUnsupportedError(BadRequestError):
    """The engine cannot take an adapter by this transport (a server without graft's memory route,
    or the shm transport to another host): the caller loads from disk instead."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What every backend implements. Adapter names are `<lora.name>-v<N>` (see graft.sync).

    Optional: `async adapter_paths() -> dict[str, str]`, each loaded adapter's source path, where the
    server reports it (vLLM): how a run tells a live run's adapters from an ended one's
    (graft.sync.owner).

    Optional: `async load_adapter_blob(name, label, blob)`, an adapter loaded from the caller's
    memory with no file (`graft.rollout.adapter_blob`: bytes, or a `SharedBlob` segment of this
    host); `label` names the version where a path would (unique per version); `memory_transports`
    says which the engine takes ("http" for bytes, "shm"). TransportUnsupportedError where it cannot."""

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        """For each request, `params.n` completions from the base model (adapter None) or the
        named adapter. Raises UnknownAdapterError when `adapter` is not loaded."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` under `name`."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`; UnknownAdapterError if it is not loaded."""
        ...

    async def list_adapters(self) -> list[str]:
        """Names of the adapters loaded now."""
        ...

    async def reload_weights(self, path: str) -> None:
        """Replace the base weights with the safetensors model at `path`, and drop any cached
        state computed with the old weights (prefix cache), so the next request sees only new weights."""
        ...

    async def health(self) -> EngineHealth:
        """Whether the engine answers, without raising."""
        ...
