"""Serving tenants' adapter versions from one engine: `TenantServing`.

Each tenant publishes versions of its adapter as `<tenant>-v1`, `<tenant>-v2`, ... through graft's
adapter sync (`graft.sync.adapter.AdapterSync`, `lora.name` = the tenant): its own publish root
(`root/<tenant>`), its own retention window of `keep_versions` loaded versions and its own in-flight
counts, so one tenant's publishes never retire another's versions. Before a version is loaded its
weights and probe logits must be finite (`graft.sync.guard`: a non-finite adapter would poison the
shared server for every tenant), and after it is loaded the server must serve exactly the tenant's
adapter (`graft.sync.verify.verify_delivery`); only then is its name handed out and sampled from.

Slots: the engine holds at most `max_loras` adapters usefully, so `tenants x keep_versions` may not
exceed it (checked when a tenant is added). Each tenant's sync is given `keep_versions` as its slots,
so it retires its oldest version before loading a new one once its window is full; with
`keep_versions == 1` the new version is loaded first (a moment with no version served is worse),
so the engine briefly holds one adapter more.

A sample or prompt-logprobs request names a version still served (verified, inside its tenant's
window) and holds it in flight (`InFlightVersions.use`) while the engine answers: a publish that
retires it meanwhile unloads it only once the request is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from graft.rollout.engine import Completion, GenerateRequest, RolloutEngine, SamplingParams
from graft.sync.adapter import AdapterSync, adapter_name, adapter_version
from graft.sync.guard import check_finite_policy
from graft.sync.inflight import InFlightVersions
from graft.sync.publish import WeightPublisher
from graft.sync.source import PolicySource
from graft.sync.verify import DEFAULT_TOLERANCE, verify_delivery


class NotServedError(ValueError):
    """A request names an adapter version that is not served: unknown, retired, or not verified."""


@dataclass
class _Tenant:
    """One tenant's serving state: its sync, in-flight counts, and the versions that passed delivery."""

    sync: AdapterSync
    inflight: InFlightVersions
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one publish at a time: versions increase
    last_tried: int = 0  # the newest version a sync was started for (its number is never reused)
    gaps: dict[int, float] = field(default_factory=dict)  # verified version -> its delivery gap


class TenantServing:
    """Tenants' adapter versions on `engine` (module docstring).

    Args:
        engine: The server (or pool) every tenant's versions are loaded into.
        root: Where each tenant's versions are published, one directory per tenant.
        max_loras: The engine's adapter slots (vLLM `--max-loras`).
        keep_versions: Versions of each tenant kept loaded, newest first (>= 1).
        tolerance: Largest allowed |engine - trainer| log-prob gap of a delivery check (fp32 default).
        transport: `sync.transport`: how versions reach the engine ("auto", "disk", "memory", "shm").

    Raises:
        ValueError: keep_versions < 1, or keep_versions > max_loras.
    """

    def __init__(self, engine: RolloutEngine, root: Path, *, max_loras: int, keep_versions: int = 2,
                 tolerance: float = DEFAULT_TOLERANCE["float32"], transport: str = "auto") -> None:
        if not 1 <= keep_versions <= max_loras:
            raise ValueError(f"need 1 <= keep_versions <= max_loras (got keep_versions={keep_versions}, "
                             f"max_loras={max_loras})")
        self.engine = engine
        self.root = Path(root)
        self.max_loras = max_loras
        self.keep_versions = keep_versions
        self.tolerance = tolerance
        self.transport = transport
        self._tenants: dict[str, _Tenant] = {}

    def add_tenant(self, tenant: str) -> None:
        """Give `tenant` a publish root, a retention window and in-flight counts of its own.

        Raises:
            ValueError: the tenant exists, its name cannot name a directory, or one more tenant's
                `keep_versions` would not fit in `max_loras`.
        """
        if tenant in self._tenants:
            raise ValueError(f"tenant {tenant!r} is served already")
        if not tenant or tenant.startswith(".") or any(c in tenant for c in "/\\\0"):
            raise ValueError(f"a tenant name must be non-empty, not start with '.', and hold no path separator, "
                             f"got {tenant!r}")
        if (len(self._tenants) + 1) * self.keep_versions > self.max_loras:
            raise ValueError(f"cannot serve tenant {tenant!r}: {len(self._tenants) + 1} tenants x keep_versions "
                             f"{self.keep_versions} adapters would exceed the engine's max_loras {self.max_loras} "
                             f"(serving {', '.join(self._tenants)}); lower keep_versions or raise max_loras")
        inflight = InFlightVersions()
        publisher = WeightPublisher(self.root / tenant, keep_versions=self.keep_versions)
        sync = AdapterSync(self.engine, publisher, lora_name=tenant, keep_versions=self.keep_versions,
                           max_loras=self.keep_versions, inflight=inflight, transport=self.transport)
        self._tenants[tenant] = _Tenant(sync, inflight)

    @property
    def tenants(self) -> list[str]:
        return list(self._tenants)

    def served(self, tenant: str) -> list[str]:
        """`tenant`'s adapter names a request may name now (verified, inside the window), oldest first."""
        state = self._tenant(tenant)
        window = state.sync.loaded[-self.keep_versions:]
        return [adapter_name(tenant, v) for v in window if v in state.gaps]

    def delivery_gap(self, adapter: str) -> float:
        """The log-prob gap the delivery check of a served `adapter` measured."""
        tenant, version = self._served_version(adapter)
        return self._tenants[tenant].gaps[version]

    async def publish(self, source: PolicySource, tenant: str) -> str:
        """Load `source`'s adapter as `tenant`'s next version, check its delivery; its adapter name.

        Raises:
            NonFinitePolicyError: non-finite weights or probe logits (nothing is loaded; the number
                is used by the next publish).
            DeliveryError: the engine does not serve it (the version stays loaded until retention
                retires it, but is never served).
            EngineError: the engine could not load it.
            ValueError: an unknown tenant.
        """
        state = self._tenant(tenant)
        async with state.lock:
            version = state.last_tried + 1
            await source.read(lambda: check_finite_policy(source, version))
            state.last_tried = version
            result = await state.sync.sync(source, version, step=version)
            gap = await verify_delivery(self.engine, source, adapter=result.adapter, tolerance=self.tolerance)
            state.gaps[version] = gap
            loaded = set(state.sync.loaded)
            state.gaps = {v: g for v, g in state.gaps.items() if v in loaded}
            return result.adapter

    async def sample(self, adapter: str | None, prompt: Sequence[int], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of `prompt` from `adapter` (None or "": the base model).

        Raises:
            NotServedError: `adapter` is not served now (the message names the versions that are).
            EngineError: the engine failed the request.
        """
        request = GenerateRequest(tuple(prompt), params)
        if not adapter:
            return (await self.engine.generate([request]))[0]
        tenant, version = self._served_version(adapter)
        async with self._tenants[tenant].inflight.use(version):  # entered with no await since the check
            return (await self.engine.generate([request], adapter=adapter))[0]

    async def prompt_logprobs(self, adapter: str | None, prompt: Sequence[int]) -> list[float | None]:
        """The engine's log-prob of each token of `prompt` under `adapter` (None or "": the base model),
        None at position 0, which nothing predicts.

        Raises:
            NotServedError: as `sample`.
            NotImplementedError: the engine cannot score prompts (it has no `prompt_logprobs`).
        """
        score = getattr(self.engine, "prompt_logprobs", None)
        if score is None:
            raise NotImplementedError(f"{type(self.engine).__name__} cannot score prompt tokens (no prompt_logprobs)")
        if not adapter:
            return await score(prompt)
        tenant, version = self._served_version(adapter)
        async with self._tenants[tenant].inflight.use(version):
            return await score(prompt, adapter=adapter)

    async def remove_tenant(self, tenant: str) -> None:
        """Unload `tenant`'s versions (waiting for the requests running on them) and free its slots."""
        state = self._tenant(tenant)
        async with state.lock:
            await state.sync.close()
        del self._tenants[tenant]

    async def close(self) -> None:
        """Unload every tenant's versions (waiting for the requests running on them)."""
        for state in self._tenants.values():
            async with state.lock:
                await state.sync.close()
                state.gaps.clear()

    def _tenant(self, tenant: str) -> _Tenant:
        if tenant not in self._tenants:
            raise ValueError(f"unknown tenant {tenant!r} (served tenants: {', '.join(self._tenants) or 'none'})")
        return self._tenants[tenant]

    def _served_version(self, adapter: str) -> tuple[str, int]:
        """(tenant, version) of `adapter` if a request may name it now, else NotServedError."""
        for tenant in self._tenants:
            version = adapter_version(tenant, adapter)
            if version is None:
                continue
            served = self.served(tenant)
            if adapter in served:
                return tenant, version
            raise NotServedError(f"adapter {adapter!r} is not served (retired, never published, or failed its "
                                 f"delivery check); tenant {tenant!r} serves {', '.join(served) or 'no version'}")
        every = [name for tenant in self._tenants for name in self.served(tenant)]
        raise NotServedError(f"adapter {adapter!r} names no served tenant's version; served adapters: "
                             f"{', '.join(every) or 'none'}")
