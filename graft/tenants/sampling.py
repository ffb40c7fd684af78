"""Sampling sessions of the Tinker service: each names a tenant's published version (`<tenant>-v<N>`
on the engine, graft.tenants.serving) or the base model, and samples from it with log-probs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from graft.rollout.engine import Completion, SamplingParams
from graft.sync.source import PolicySource
from graft.tenants.futures import Futures, RequestFailed

NO_ENGINE = "this service has no inference engine: sampling is off"


@dataclass(frozen=True)
class SampleResult:
    """A sample request's completions, and the prompt's log-probs when asked for."""

    completions: list[Completion]
    prompt_logprobs: list[float | None] | None


class Samplers:
    """Sampling session id -> the adapter it samples (None: the base); `serving` None: no engine."""

    def __init__(self, serving, futures: Futures) -> None:
        self._serving = serving
        self._futures = futures
        self._adapters: dict[str, str | None] = {}  # sampling session id -> adapter name
        self._paths: dict[str, str] = {}  # tinker:// path of saved sampler weights -> adapter name
        self._ids = itertools.count(1)
        self._sequence_ids = itertools.count(1)

    def add_tenant(self, tenant: str) -> None:
        """Make room for `tenant`'s versions on the engine (refused when its slots are all spoken for)."""
        if self._serving is not None:
            self._serving.add_tenant(tenant)

    async def remove_tenant(self, tenant: str) -> None:
        """Unload `tenant`'s versions and free its slots; its sampling sessions then fail clearly."""
        if self._serving is not None:
            await self._serving.remove_tenant(tenant)

    async def publish(self, source: PolicySource, model_id: str, name: str | None) -> dict:
        """Publish `source`'s tenant as its next version (delivery-verified): a new sampling session of
        it (`name` None), or sampler weights at `tinker://<model id>/sampler_weights/<name>`."""
        if self._serving is None:
            raise RequestFailed(NO_ENGINE)
        adapter = await self._serving.publish(source, source.tenant)
        if name is None:
            return {"sampling_session_id": self._new(adapter)}
        path = f"tinker://{model_id}/sampler_weights/{name}"
        self._paths[path] = adapter
        return {"path": path}

    def create(self, model_path: str | None) -> str:
        """A sampling session of the sampler weights at `model_path` (None: the base model)."""
        if model_path is None:
            return self._new(None)
        if (adapter := self._paths.get(model_path)) is None:
            raise RequestFailed(f"no sampler weights at {model_path!r} (known: {', '.join(self._paths) or 'none'})")
        return self._new(adapter)

    def adapter(self, sampler_id: str) -> str | None:
        if sampler_id not in self._adapters:
            raise RequestFailed(f"unknown sampling session {sampler_id!r}")
        return self._adapters[sampler_id]

    def sample(self, sampler_id: str, prompt: Sequence[int], params: SamplingParams, with_prompt_logprobs: bool
               ) -> tuple[str, list[str]]:
        """Start sampling `params.n` completions; the request id and one sequence id per sample."""
        adapter = self.adapter(sampler_id)
        if self._serving is None:
            raise RequestFailed(NO_ENGINE)
        if not prompt:
            raise RequestFailed("the prompt has no tokens")
        sequence_ids = [f"seq-{next(self._sequence_ids)}" for _ in range(params.n)]
        return self._futures.job(self._sample(adapter, prompt, params, with_prompt_logprobs)), sequence_ids

    async def close(self) -> None:
        if self._serving is not None:
            await self._serving.close()

    async def _sample(self, adapter: str | None, prompt: Sequence[int], params: SamplingParams,
                      with_prompt_logprobs: bool) -> SampleResult:
        completions = await self._serving.sample(adapter, prompt, params)
        prompt_logprobs = await self._serving.prompt_logprobs(adapter, prompt) if with_prompt_logprobs else None
        return SampleResult(completions, prompt_logprobs)

    def _new(self, adapter: str | None) -> str:
        sampler_id = f"sampler-{next(self._ids)}"
        self._adapters[sampler_id] = adapter
        return sampler_id
