"""The order in which the Tinker service runs models' operations: `Scheduler`.

A model's operations carry the client's sequence ids and run in that order, one at a time, whatever
order they arrive in (the SDK sends the chunks of a large batch concurrently, the first last).

Batching across tenants: when models' next operations are forward_backward passes, they run as ONE
forward and backward over all their datums (grouped by loss and its config), so tenants who train at
the same time share each pass over the frozen base. Tenants' clients are independent programs, and
each pass that starts alone would hold every later tenant back by a whole pass, so passes gather:

- while a pass runs, the passes that arrive wait for it to end and then run as one (the trainer has
  one thread: they could not start sooner);
- a pass ready to run waits, at most `batch_window_s` from its arrival, while another model is in
  its training phase (`Scheduler._expected`: its last pass arrived less than 1.5 of its steps ago,
  or it was made but has not trained yet), and goes as soon as every such model's pass is there. A
  lone client waits for no one. Measured (`graft bench cookbook`, math_rl, SmolLM2-135M, 2 groups x 4
  samples, 3 steps, on 2 shared and overloaded cores): two recipes' passes arrived a median 40 s
  apart (p90 59 s) with steps of 750 s, and none of 6 passes held both; with this gathering (cap
  120 s) 1 of 5 did. There the gaps (clients started minutes apart) outran the cap, so each miss cost
  the waiting tenant its cap; a lone client's step was the same (174 s before, 179 s after).

Each round takes at most one operation per model, so a client that floods one model's queue gets
that model's turn and no more.

One tenant's bad input never fails another's operation: datums are checked when parsed, and should a
shared pass still fail, every tenant's gradients are put back as they were before it and each
operation runs again alone, so only the one at fault fails.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graft.tenants.futures import Futures, RequestFailed, as_failure
from graft.tenants.policy import DatumResult, TenantPolicy

log = logging.getLogger(__name__)

FORWARD_BACKWARD = "forward_backward"
SKIP = "skip"  # a refused request's place in its model's order: nothing to do, the next may go
EXPECTED_PERIODS = 1.5  # a tenant whose last pass arrived less than 1.5 of its steps ago is training
GATHER_PERIODS = 0.5  # a gathered pass waits at most half its tenant's step for others
NEW_S = 60.0  # a model made (or first trained) this recently, its step not yet measured, is training
CHUNKS_S = 0.5  # arrivals closer than this are one batch's chunks (the SDK sends them at once), not steps
ISSUED_KEPT = 64  # operations per model whose request ids a resent request gets back (`submit`)


@dataclass(frozen=True)
class ForwardResult:
    """A forward_backward's per-datum results and its summed loss."""

    datums: list[DatumResult]

    @property
    def loss(self) -> float:
        return sum(datum.loss for datum in self.datums)


@dataclass
class TrainerClock:
    """How long the model's thread spent in jobs (passes, optimizer steps, saves) since the first
    forward_backward pass began: `graft bench cookbook`'s trainer busy fraction. Before that first pass
    clients are still starting (8 recipe processes import for minutes on 2 cores), which is not the
    trainer's to count."""

    busy_s: float = 0.0
    start_s: float | None = None  # when the first pass began (time.monotonic)
    end_s: float = 0.0  # when the last job ended
    busy_by_job_s: Counter = field(default_factory=Counter)  # the same seconds by the job's function name

    def timed(self, job: Callable[[], Any]) -> Callable[[], Any]:
        """`job`, counting its time on the thread once the first pass began."""
        name = getattr(getattr(job, "func", job), "__name__", "job")  # a partial's function, or the job's

        def run() -> Any:
            begun = time.monotonic()
            try:
                return job()
            finally:
                if self.start_s is not None:
                    seconds = time.monotonic() - max(begun, self.start_s)
                    self.busy_s += seconds
                    self.busy_by_job_s[name] += seconds
                    self.end_s = time.monotonic()
        return run

    def busy_fraction(self) -> float:
        """Busy seconds over the seconds from the first pass to the last job's end (0 before a pass)."""
        span_s = self.end_s - self.start_s if self.start_s is not None else 0.0
        return self.busy_s / span_s if span_s > 0 else 0.0


@dataclass
class QueuedOperation:
    """One ordered operation of a model: what to do (`kind`, `payload`) and where its result goes."""

    kind: str
    seq_id: int
    payload: Any
    future: asyncio.Future
    arrived_s: float = field(default_factory=time.monotonic)


@dataclass
class Model:
    """A training model: a user's tenant (its adapter), and its operations waiting for their turn."""

    model_id: str
    owner: str
    tenant: str
    rank: int
    next_seq: int = 1
    waiting: dict[int, QueuedOperation] = field(default_factory=dict)
    busy: bool = False
    created_by: str = ""  # the request id of the create_model that made it
    issued: dict[int, tuple[str, str]] = field(default_factory=dict)  # recent seq_id -> (kind, request id)
    created_s: float = field(default_factory=time.monotonic)
    last_arrived_s: float | None = None  # when its last forward_backward arrived (time.monotonic)
    period_s: float | None = None  # the interval between its last two forward_backward arrivals


class Scheduler:
    """Runs models' operations in their order (module docstring).

    Args:
        policy: the tenants' adapters on the shared base.
        futures: where each operation's result goes.
        run_on_model: runs a function on the model's one thread, after the jobs before it.
        single: runs one operation that is not a forward_backward (its result, or raises).
        batch_window_s: how long, at most, a forward_backward waits for the passes of tenants in their
            training phase to join it (module docstring).
    """

    def __init__(self, policy: TenantPolicy, futures: Futures, run_on_model: Callable[[Callable], Awaitable],
                 single: Callable[[Model, QueuedOperation], Awaitable], batch_window_s: float) -> None:
        self.policy, self.futures, self.run_on_model, self.single = policy, futures, run_on_model, single
        self.batch_window_s = batch_window_s
        self.models: dict[str, Model] = {}
        self.pass_sizes: Counter[int] = Counter()  # tenants in a forward_backward pass -> passes so far
        self.pass_losses: Counter[str] = Counter()  # loss -> passes so far
        self.trained_tokens = 0  # tokens of the datums of passes with a backward
        self.arrivals: deque[tuple[float, str]] = deque(maxlen=4096)  # forward_backward (time.monotonic, model id)
        self.clock = TrainerClock()
        self._gathered: list[tuple[Model, QueuedOperation]] = []  # passes taken, waiting for the trainer or others
        self._passes_running = 0
        self._wake = asyncio.Event()

    def submit(self, model: Model, seq_id: int, kind: str, payload: Any) -> str:
        """Queue `kind` for `model` at its place `seq_id`; its request id.

        Raises:
            RequestFailed: a sequence id already used.
        """
        if (issued := model.issued.get(seq_id)) is not None and issued[0] == kind:
            return issued[1]  # sent again, its answer lost (the service's `_created`)
        if seq_id < model.next_seq or seq_id in model.waiting:
            raise RequestFailed(f"model {model.model_id!r}: seq_id {seq_id} was used already (next: {model.next_seq})")
        request_id, future = self.futures.new(model.owner)
        model.waiting[seq_id] = op = QueuedOperation(kind, seq_id, payload, future)
        if kind == FORWARD_BACKWARD:
            self.arrivals.append((op.arrived_s, model.model_id))
            if model.last_arrived_s is not None and op.arrived_s - model.last_arrived_s > CHUNKS_S:
                model.period_s = op.arrived_s - model.last_arrived_s
            model.last_arrived_s = op.arrived_s
        model.issued[seq_id] = (kind, request_id)
        model.issued.pop(seq_id - ISSUED_KEPT, None)
        self._wake.set()
        return request_id

    def skip(self, model: Model, seq_id: int) -> None:
        """Give up `seq_id`'s place in `model`'s order: its request was refused (a 4xx), and the
        client has counted it, so the operations after it must not wait for it."""
        if seq_id >= model.next_seq and seq_id not in model.waiting:
            model.waiting[seq_id] = QueuedOperation(SKIP, seq_id, None, asyncio.get_running_loop().create_future())
            self._wake.set()

    async def run(self) -> None:
        """Run each model's next operation once its turn comes; forward_backward passes together."""
        loop = asyncio.get_running_loop()
        while True:
            await self._next_wake()
            for model, op in self._take_ready(lambda op: op.kind != FORWARD_BACKWARD):
                loop.create_task(self._run([model], [op], _listed(self.single(model, op))))
            if self._passes_running:
                continue  # the passes that arrive meanwhile gather for the next one
            self._gathered += self._take_ready(lambda op: op.kind == FORWARD_BACKWARD)
            if self._gathered and (time.monotonic() >= self._deadline_s() or not self._expected()):
                self._dispatch(loop, self._gathered)
                self._gathered = []

    async def _next_wake(self) -> None:
        """Until something changed, or the gathered passes' deadline."""
        timeout_s = None
        if self._gathered and not self._passes_running:
            timeout_s = max(0.0, self._deadline_s() - time.monotonic())
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except TimeoutError:
            pass
        self._wake.clear()

    def _deadline_s(self) -> float:
        """The earliest gathered pass's arrival plus its wait: half its tenant's step (another tenant
        half a step out of phase arrives within it), at most `batch_window_s`."""
        return min(op.arrived_s + min(self.batch_window_s, GATHER_PERIODS * (model.period_s or self.batch_window_s))
                   for model, op in self._gathered)

    def _expected(self) -> bool:
        """Whether a model not gathered is in its training phase: its last forward_backward arrived
        less than `EXPECTED_PERIODS` of its step period ago (its period not yet measured: `NEW_S`), or
        it was created less than `NEW_S` ago and has not trained yet (clients started together)."""
        now, gathered = time.monotonic(), {model.model_id for model, _ in self._gathered}
        return any(model.model_id not in gathered and (
            now - model.created_s < NEW_S if model.last_arrived_s is None else
            now - model.last_arrived_s < (NEW_S if model.period_s is None else EXPECTED_PERIODS * model.period_s))
            for model in self.models.values())

    def _dispatch(self, loop: asyncio.AbstractEventLoop, passes: list[tuple[Model, QueuedOperation]]) -> None:
        groups: dict[tuple[str, str, bool], list[tuple[Model, QueuedOperation]]] = {}
        for model, op in passes:
            payload = op.payload
            key = (payload["loss"], json.dumps(payload["config"], sort_keys=True), payload["forward_only"])
            groups.setdefault(key, []).append((model, op))
        for group in groups.values():
            self._passes_running += 1
            loop.create_task(self._run_pass(group))

    def _take_ready(self, wanted: Callable[[QueuedOperation], bool]) -> list[tuple[Model, QueuedOperation]]:
        ready = []
        for model in self.models.values():
            if not model.busy and (op := model.waiting.get(model.next_seq)) is not None and wanted(op):
                del model.waiting[model.next_seq]
                model.busy = True
                ready.append((model, op))
        return ready

    async def _run(self, models: list[Model], ops: list[QueuedOperation], work: Awaitable[list]) -> None:
        """Await `work` (one result per op), resolve the ops' futures, then free the models for their next."""
        try:
            for op, result in zip(ops, await work, strict=True):
                _settle(op, result)
        except Exception as error:  # every failure reaches the client as its request's result
            failure = as_failure(error)
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(failure)
        finally:
            for model in models:
                model.next_seq += 1
                model.busy = False
            self._wake.set()

    async def _run_pass(self, group: list[tuple[Model, QueuedOperation]]) -> None:
        models, ops = [model for model, _ in group], [op for _, op in group]
        log.debug("one pass for %d tenant(s): %d datums", len(ops), sum(len(op.payload["datums"]) for op in ops))
        self.pass_sizes[len(ops)] += 1
        self.pass_losses[ops[0].payload["loss"]] += 1
        if not ops[0].payload["forward_only"]:
            self.trained_tokens += sum(len(datum.tokens) for op in ops for datum in op.payload["datums"])
        if self.clock.start_s is None:
            self.clock.start_s = time.monotonic()
        try:
            await self._run(models, ops, self.run_on_model(functools.partial(self._shared_pass, models, ops)))
        finally:
            self._passes_running -= 1
            self._wake.set()

    def _shared_pass(self, models: list[Model], ops: list[QueuedOperation]) -> list[ForwardResult | RequestFailed]:
        """One pass over every op's datums; if it fails with several tenants in it, each op alone
        (from the gradients before it), so that a failure is told only to the op at fault."""
        payload = ops[0].payload
        saved = {model.tenant: _gradients(self.policy, model.tenant) for model in models} if len(ops) > 1 else None
        try:
            return self._pass(ops, payload)
        except Exception as error:
            if saved is None:
                raise
            log.warning("a pass of %d tenants failed (%s): each runs alone", len(ops), error)
            for grads in saved.values():
                _restore(grads)
        results: list[ForwardResult | RequestFailed] = []
        for model, op in zip(models, ops, strict=True):
            try:
                results += self._pass([op], payload)
            except Exception as error:
                _restore(saved[model.tenant])  # a pass in chunks may have added part of its gradients
                results.append(as_failure(error))
        return results

    def _pass(self, ops: list[QueuedOperation], payload: dict) -> list[ForwardResult]:
        datums = [datum for op in ops for datum in op.payload["datums"]]
        results = self.policy.forward_backward(datums, payload["loss"], backward=not payload["forward_only"],
                                               config=payload["config"])
        starts = list(itertools.accumulate((len(op.payload["datums"]) for op in ops), initial=0))
        return [ForwardResult(results[start:end]) for start, end in itertools.pairwise(starts)]


def _settle(op: QueuedOperation, result: Any) -> None:
    if isinstance(result, RequestFailed):
        op.future.set_exception(result)
    else:
        op.future.set_result(result)


def _gradients(policy: TenantPolicy, tenant: str) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
    """Each of `tenant`'s parameters with a copy of its gradient so far (None: none yet)."""
    return [(param, None if param.grad is None else param.grad.clone())
            for param in policy.parameters(tenant).values()]


def _restore(saved: list[tuple[torch.nn.Parameter, torch.Tensor | None]]) -> None:
    for param, grad in saved:
        param.grad = grad


async def _listed(work: Awaitable) -> list:
    return [await work]
