"""`EnginePool`: N rollout engines behind the one `RolloutEngine` protocol.

Generation is spread by least outstanding requests: each `GenerateRequest` goes to the engine with
the fewest requests in flight right now (ties: round robin), so a slow or busy engine gets fewer new
requests without any timing model. Adapter loads/unloads and weight reloads are broadcast to every
engine at once, and a failure anywhere is raised (`PoolBroadcastError`) naming each failing engine's
address and error, and the engines that succeeded: a policy version missing on one engine is never
silently served by the others.

An engine's address is its `address` attribute (HTTP clients: their base URL; the in-process
reference engine: "in-process"), else its repr.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

from graft.rollout.engine import (
    Completion,
    EngineError,
    EngineHealth,
    GenerateRequest,
    RolloutEngine,
)
from graft.rollout.http_util import gather_cancel_on_error


class PoolBroadcastError(EngineError):
    """A broadcast call failed on some engines. `failures` maps address -> exception (each kept
    whole, with its own type and traceback); `succeeded` lists the addresses where it worked."""

    def __init__(self, operation: str, failures: dict[str, BaseException], succeeded: Sequence[str]) -> None:
        reasons = "; ".join(f"{address}: {type(exc).__name__}: {exc}" for address, exc in failures.items())
        total = len(failures) + len(succeeded)
        super().__init__(f"{operation} failed on {len(failures)}/{total} engine(s): {reasons} "
                         f"(succeeded on: {', '.join(succeeded) or 'none'})")
        self.operation = operation
        self.failures = dict(failures)
        self.succeeded = list(succeeded)


def engine_address(engine: object) -> str:
    """Where an engine is, for messages and health: its `address` attribute, else its repr."""
    return str(getattr(engine, "address", repr(engine)))


class EnginePool:
    """Least-outstanding-requests generation over `engines`, broadcast for everything else.

    Args:
        engines: One or more RolloutEngines (HTTP clients, the reference engine, or pools).

    Raises:
        ValueError: No engines.
    """

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.addresses = _unique([engine_address(e) for e in self.engines])
        self.address = f"pool[{', '.join(self.addresses)}]"
        self._in_flight = [0] * len(self.engines)
        self._next = 0  # round-robin start among engines tied for fewest in flight

    def __repr__(self) -> str:
        return f"EnginePool({self.addresses})"

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests in flight per engine address, now."""
        return dict(zip(self.addresses, self._in_flight))

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        """Each request to the least-busy engine; answers in input order. The first engine error is
        raised as is (the other requests of this call are cancelled)."""
        return await gather_cancel_on_error(self._generate_one(r, adapter) for r in requests)

    def _pick(self) -> int:
        fewest = min(self._in_flight)
        count = len(self.engines)
        for k in range(count):
            i = (self._next + k) % count
            if self._in_flight[i] == fewest:
                self._next = (i + 1) % count
                return i
        raise AssertionError("min() of the counters is one of them")

    async def _generate_one(self, request: GenerateRequest, adapter: str | None) -> list[Completion]:
        # Pick and count before the first await, so requests started together see each other.
        i = self._pick()
        self._in_flight[i] += 1
        try:
            (completions,) = await self.engines[i].generate([request], adapter)
        finally:
            self._in_flight[i] -= 1
        return completions

    # -- broadcast ------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Load on every engine at once; PoolBroadcastError if any engine failed."""
        await self._broadcast(f"load_adapter({name!r})", lambda e: e.load_adapter(name, path))

    async def unload_adapter(self, name: str) -> None:
        """Unload on every engine at once; PoolBroadcastError if any engine failed."""
        await self._broadcast(f"unload_adapter({name!r})", lambda e: e.unload_adapter(name))

    async def reload_weights(self, path: str) -> None:
        """Reload base weights on every engine at once; PoolBroadcastError if any engine failed."""
        await self._broadcast(f"reload_weights({path!r})", lambda e: e.reload_weights(path))

    async def adapters_by_engine(self) -> dict[str, list[str]]:
        """Each engine's loaded adapters, by address."""
        names = await self._broadcast("list_adapters()", lambda e: e.list_adapters())
        return dict(zip(self.addresses, (sorted(n) for n in names)))

    async def list_adapters(self) -> list[str]:
        """Adapters loaded on ALL engines (the ones a request may name, whichever engine gets it)."""
        per_engine = await self.adapters_by_engine()
        common = set.intersection(*(set(names) for names in per_engine.values()))
        return sorted(common)

    async def _broadcast(self, operation: str, call: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        """Run `call` on every engine at once; return the answers in engine order, or raise
        PoolBroadcastError naming every failure once all engines have answered."""
        results = await asyncio.gather(*(call(e) for e in self.engines), return_exceptions=True)
        failures = {a: r for a, r in zip(self.addresses, results) if isinstance(r, BaseException)}
        if failures:
            succeeded = [a for a in self.addresses if a not in failures]
            raise PoolBroadcastError(operation, failures, succeeded) from next(iter(failures.values()))
        return results

    # -- health ---------------------------------------------------------------------------------

    async def health_all(self) -> list[EngineHealth]:
        """Each engine's health, in engine order; never raises."""
        return list(await asyncio.gather(*(self._health_of(a, e) for a, e in zip(self.addresses, self.engines))))

    async def health(self) -> EngineHealth:
        """Healthy only if every engine is; adapters are those loaded on every engine; `detail`
        names the unhealthy engines and why."""
        each = await self.health_all()
        down = [f"{h.address}: {h.detail or 'unhealthy'}" for h in each if not h.healthy]
        common = set.intersection(*(set(h.adapters) for h in each))
        return EngineHealth(self.address, not down, tuple(sorted(common)), "; ".join(down))

    @staticmethod
    async def _health_of(address: str, engine: RolloutEngine) -> EngineHealth:
        try:
            return await engine.health()
        except Exception as exc:  # health() must not raise; an engine that does is reported unhealthy
            return EngineHealth(address, False, (), f"health() raised {type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        """Close every engine that holds connections (has an `aclose`)."""
        await asyncio.gather(*(e.aclose() for e in self.engines if hasattr(e, "aclose")))


def _unique(addresses: list[str]) -> list[str]:
    """Addresses as given, with `#i` appended to repeats (two clients of one server stay apart)."""
    seen: dict[str, int] = {}
    out = []
    for address in addresses:
        seen[address] = seen.get(address, 0) + 1
        out.append(address if seen[address] == 1 else f"{address}#{seen[address]}")
    return out
