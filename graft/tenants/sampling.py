"""Sampling sessions of the Tinker service: each names a tenant's published version (`<tenant>-v<N>`
on the engine, graft.tenants.serving) or the base model, and samples from it with log-probs.

Sampling sessions and saved sampler weights belong to the user who made them: another user's id or
`tinker://` path is answered as one that does not exist. Each user has at most `engine_share`
(`--max-engine-requests`) requests at the engine at once, the rest wait their turn here: the engine
takes requests in the order they come (vLLM's scheduler is first come, first served, up to its
`max_num_seqs`), so one user's flood of samples would otherwise hold other users' behind it."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from graft.rollout.engine import Completion, SamplingParams
from graft.sync.source import PolicySource
from graft.tenants.futures import Futures, NotFound, RequestFailed

NO_ENGINE = "this service has no inference engine: sampling is off"
KEEP_SAMPLERS = 256  # sampling sessions kept per user, newest


@dataclass(frozen=True)
class SampleResult:
    """A sample request's completions, and the prompt's log-probs when asked for."""

    completions: list[Completion]
    prompt_logprobs: list[float | None] | None


class Samplers:
    """Sampling session id -> the adapter it samples (None: the base); `serving` None: no engine."""

    def __init__(self, serving, futures: Futures, engine_share: int = 32) -> None:
        self._serving = serving
        self._futures = futures
        self._turns: defaultdict[str, asyncio.Semaphore] = defaultdict(lambda: asyncio.Semaphore(engine_share))
        self._adapters: dict[tuple[str, str], str | None] = {}  # (user, sampling session id) -> adapter name
        self._paths: dict[tuple[str, str], str] = {}  # (user, tinker:// path of sampler weights) -> adapter
        self._sequence_ids = itertools.count(1)

    def add_tenant(self, tenant: str) -> None:
        """Make room for `tenant`'s versions on the engine (refused when its slots are all spoken for)."""
        if self._serving is not None:
            self._serving.add_tenant(tenant)

    async def remove_tenant(self, tenant: str) -> None:
        """Unload `tenant`'s versions and free its slots; its sampling sessions and sampler weights
        are forgotten (asked for, they are unknown)."""
        if self._serving is not None:
            await self._serving.remove_tenant(tenant)
        for table in (self._adapters, self._paths):
            for key in [key for key, adapter in table.items() if adapter and adapter.startswith(f"{tenant}-v")]:
                del table[key]

    async def publish(self, owner: str, source: PolicySource, model_id: str, name: str | None) -> dict:
        """Publish `source`'s tenant as its next version (delivery-verified): a new sampling session of
        it (`name` None), or sampler weights at `tinker://<model id>/sampler_weights/<name>`, `owner`'s."""
        if self._serving is None:
            raise RequestFailed(NO_ENGINE)
        adapter = await self._serving.publish(source, source.tenant)
        if name is None:
            return {"sampling_session_id": self._new(owner, adapter)}
        path = f"tinker://{model_id}/sampler_weights/{name}"
        self._paths[owner, path] = adapter
        return {"path": path}

    def create(self, owner: str, model_path: str | None) -> str:
        """A sampling session of `owner`'s sampler weights at `model_path` (None: the base model)."""
        if model_path is None:
            return self._new(owner, None)
        if (adapter := self._paths.get((owner, model_path))) is None:
            raise NotFound(f"no sampler weights at {model_path!r}")
        return self._new(owner, adapter)

    def sampler_paths(self, owner: str) -> list[str]:
        return [path for user, path in self._paths if user == owner]

    def forget(self, owner: str, path: str) -> bool:
        """Forget `owner`'s sampler weights at `path` (False: there were none)."""
        return self._paths.pop((owner, path), None) is not None

    def adapter(self, owner: str, sampler_id: str) -> str | None:
        if (owner, sampler_id) not in self._adapters:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        return self._adapters[owner, sampler_id]

    def sample(self, owner: str, sampler_id: str, prompt: Sequence[int], params: SamplingParams,
               with_prompt_logprobs: bool) -> tuple[str, list[str]]:
        """Start sampling `params.n` completions; the request id and one sequence id per sample."""
        adapter = self.adapter(owner, sampler_id)
        if self._serving is None:
            raise RequestFailed(NO_ENGINE)
        if not prompt:
            raise RequestFailed("the prompt has no tokens")
        sequence_ids = [f"seq-{next(self._sequence_ids)}" for _ in range(params.n)]
        work = self._sample(owner, adapter, prompt, params, with_prompt_logprobs)
        return self._futures.job(owner, work), sequence_ids

    async def close(self) -> None:
        if self._serving is not None:
            await self._serving.close()

    async def _sample(self, owner: str, adapter: str | None, prompt: Sequence[int], params: SamplingParams,
                      with_prompt_logprobs: bool) -> SampleResult:
        async with self._turns[owner]:
            completions = await self._serving.sample(adapter, prompt, params)
            prompt_logprobs = await self._serving.prompt_logprobs(adapter, prompt) if with_prompt_logprobs else None
        return SampleResult(completions, prompt_logprobs)

    def _new(self, owner: str, adapter: str | None) -> str:
        """A new sampling session; past `KEEP_SAMPLERS` of `owner`'s the oldest is forgotten (the SDK
        makes one per `save_weights_and_get_sampling_client`, a step's, and samples from the newest)."""
        sampler_id = f"sampler-{secrets.token_hex(8)}"
        self._adapters[owner, sampler_id] = adapter
        owned = [key for key in self._adapters if key[0] == owner]
        for key in owned[:-KEEP_SAMPLERS]:
            del self._adapters[key]
        return sampler_id
