"""The Tinker service's state and scheduling: `TenantService`.

Sessions own training models (one tenant each: its own LoRA adapter and optimizer on the shared
base, `graft.tenants.policy`) and sampling sessions (a tenant's published version, or the base).
A model's operations carry the client's sequence ids and run in that order, one at a time, whatever
order they arrive in (the SDK sends the chunks of a large batch concurrently, the first last).

Batching across tenants: when models' next operations are forward_backward passes, they run as ONE
forward and backward over all their datums (grouped by loss), so tenants who train at the same time
share each pass over the frozen base. A first pass waits `batch_window_s` for others to arrive:
tenants' clients are independent programs, and a pass that had just started would hold every later
tenant back by a whole pass. All model work runs on one thread, one job at a time; HTTP handling,
sampling and adapter syncs run on the event loop beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from graft.tenants.checkpoint import load_tenant, save_tenant, tenant_spec
from graft.tenants.futures import Futures, RequestFailed, as_failure
from graft.tenants.policy import AdamParams, DatumResult, TenantPolicy, TenantSpec
from graft.tenants.sampling import Samplers
from graft.tenants.source import TenantSource

log = logging.getLogger(__name__)
T = TypeVar("T")

FORWARD_BACKWARD, OPTIM_STEP, SAVE_FOR_SAMPLER = "forward_backward", "optim_step", "save_weights_for_sampler"
SAVE_STATE, LOAD_STATE = "save_weights", "load_weights"
SKIP = "skip"  # a refused request's place in its model's order: nothing to do, the next may go
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ForwardResult:
    """A forward_backward's per-datum results and its summed loss."""

    datums: list[DatumResult]

    @property
    def loss(self) -> float:
        return sum(datum.loss for datum in self.datums)


@dataclass
class Op:
    """One ordered operation of a model: what to do (`kind`, `payload`) and where its result goes."""

    kind: str
    seq_id: int
    payload: Any
    future: asyncio.Future


ISSUED_KEPT = 64  # operations per model whose request ids a resent request gets back (`submit`)


@dataclass
class Model:
    """A training model: a tenant's adapter, and its operations waiting for their turn."""

    model_id: str
    tenant: str
    rank: int
    next_seq: int = 1
    waiting: dict[int, Op] = field(default_factory=dict)
    busy: bool = False
    created_by: str = ""  # the request id of the create_model that made it
    issued: dict[int, tuple[str, str]] = field(default_factory=dict)  # recent seq_id -> (kind, request id)


class TenantService:
    """The Tinker API's model over a `TenantPolicy` (module docstring).

    Args:
        policy: the tenants' adapters on the shared base.
        serving: publishes tenants' versions to the engine and samples (graft.tenants.serving); None:
            training only.
        base_model: the name clients give to create models and that `get_info` reports.
        tokenizer_id: what clients load the tokenizer from (`get_info`'s `tokenizer_id`).
        max_rank: the largest LoRA rank the engine serves.
        state_root: where `save_state` writes tenants' states (graft.tenants.checkpoint).
        batch_window_s: how long a forward_backward waits for other tenants' passes to join it.
        session_timeout_s: a session not heard from for this long (the SDK sends a heartbeat every
            10 s while its client lives) is finished as if its client had closed it: a client that
            died without closing would otherwise hold its tenants' engine slots for good.
    """

    def __init__(self, policy: TenantPolicy, serving, *, base_model: str, tokenizer_id: str, max_rank: int,
                 state_root: Path, batch_window_s: float = 0.01, session_timeout_s: float = 300.0) -> None:
        self.policy = policy
        self.state_root = state_root
        self.base_model = base_model
        self.tokenizer_id = tokenizer_id
        self.max_rank = max_rank
        self.batch_window_s = batch_window_s
        self.futures = Futures()
        self.models: dict[str, Model] = {}
        self.sessions: dict[str, list[str]] = {}  # session id -> its models' ids
        self._finished: set[str] = set()
        self._heard: dict[str, float] = {}  # session id -> when it last sent a heartbeat (monotonic)
        self.session_timeout_s = session_timeout_s
        self.sampling = Samplers(serving, self.futures)
        self.pass_sizes: Counter[int] = Counter()  # tenants in a forward_backward pass -> passes so far
        self._session_ids = itertools.count(1)
        self._tenant_ids = itertools.count(1)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="graft-tenants-model")
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None

    async def run_on_model(self, job: Callable[[], T]) -> T:
        """`job()` on the model's thread, after the jobs before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, job)

    def start(self) -> None:
        """Start scheduling operations (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self._scheduler = loop.create_task(self._schedule())
        self._reaper = loop.create_task(self._expire_silent_sessions())

    async def close(self) -> None:
        for task in (self._scheduler, self._reaper):
            if task is not None:
                task.cancel()
        await self.sampling.close()
        self._thread.shutdown(wait=True)

    # sessions and models

    def create_session(self) -> str:
        session_id = f"session-{next(self._session_ids)}"
        self.sessions[session_id] = []
        self._heard[session_id] = time.monotonic()
        return session_id

    def heartbeat(self, session_id: str) -> bool:
        """Note that `session_id`'s client lives; False when the session is finished (or unknown)."""
        if session_id not in self.sessions or session_id in self._finished:
            return False
        self._heard[session_id] = time.monotonic()
        return True

    async def _expire_silent_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.session_timeout_s / 2))
            now = time.monotonic()
            for session_id, heard in list(self._heard.items()):
                if now - heard > self.session_timeout_s and session_id not in self._finished:
                    log.warning("session %s sent no heartbeat for %.0f s: finished, its tenants released",
                                session_id, now - heard)
                    await self.finish_session(session_id)

    async def finish_session(self, session_id: str) -> None:
        """End a session: once each of its models' queued operations are done, its tenant goes (versions
        unloaded, engine slots and the adapter's memory freed) and its id is unknown from then on."""
        if session_id in self._finished:
            return  # a retried finish (the SDK resends one whose answer it did not get)
        models = self._session(session_id)
        self._finished.add(session_id)
        for model_id in models:
            model = self.models[model_id]
            while model.busy or model.next_seq in model.waiting:  # not for operations whose turn never comes
                await asyncio.sleep(0.05)
            for op in model.waiting.values():
                if not op.future.done():
                    op.future.set_exception(RequestFailed(f"session {session_id!r} finished before its turn"))
            del self.models[model_id]
            await self.sampling.remove_tenant(model.tenant)
            await self.run_on_model(functools.partial(self.policy.remove, model.tenant))
            log.info("model %s (tenant %s) released: its session finished", model_id, model.tenant)
        del self.sessions[session_id]
        self._heard.pop(session_id, None)

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, lora: dict) -> str:
        """A new tenant for `lora` (the SDK's LoraConfig); a request id whose result is `{"model_id"}`.
        A tenant's alpha is its rank (LoRA scaling 1); `train_unembed` is not supported and ignored (the
        adapter covers attention and MLP).

        Raises:
            RequestFailed: an unknown session or base model, a rank the engine cannot serve, or no
                LoRA target asked for.
        """
        if (retried := self._created(session_id, model_seq_id)) is not None:
            return retried
        self._check_base(base_model)
        rank = int(lora.get("rank", 32))
        targets = (ATTENTION if lora.get("train_attn", True) else ()) + (MLP if lora.get("train_mlp", True) else ())
        if not targets:
            raise RequestFailed("train_attn and train_mlp are both false: the adapter would train nothing")
        seed = int(lora["seed"]) if lora.get("seed") is not None else len(self.models)
        model = self._new_model(session_id, model_seq_id, rank)
        spec = TenantSpec(model.tenant, rank=rank, alpha=float(rank), target_modules=targets, seed=seed)
        model.created_by = self._job(self.run_on_model(functools.partial(self._add_tenant, spec, model.model_id)))
        return model.created_by

    def create_model_from_state(self, session_id: str, model_seq_id: int, path: str, with_optimizer: bool) -> str:
        """A new tenant whose adapter (and optimizer, `with_optimizer`) is the state saved at `path`."""
        if (retried := self._created(session_id, model_seq_id)) is not None:
            return retried
        state_dir = self.state_dir(path)
        spec = tenant_spec(state_dir, "")
        model = self._new_model(session_id, model_seq_id, spec.rank)

        def add_and_load() -> dict:
            self._add_tenant(dataclasses.replace(spec, name=model.tenant), model.model_id)
            load_tenant(self.policy, model.tenant, state_dir, with_optimizer=with_optimizer)
            return {"path": path, "model_id": model.model_id}

        model.created_by = self._job(self.run_on_model(add_and_load))
        return model.created_by

    def _created(self, session_id: str, model_seq_id: int) -> str | None:
        """The request id of the session's model `model_seq_id` if it was created already. The SDK sends
        a request again when its answer was lost (a timeout: under a full test run's load a cookbook
        recipe's first save_weights_for_sampler was refused so, which failed the run), and the same
        request gets the same answer here and in `submit`."""
        model = self.models.get(f"{session_id}:train:{model_seq_id}")
        return None if model is None else model.created_by

    def _new_model(self, session_id: str, model_seq_id: int, rank: int) -> Model:
        self._session(session_id)
        if not 1 <= rank <= self.max_rank:
            raise RequestFailed(f"LoRA rank {rank} is out of range: the engine here serves ranks 1..{self.max_rank}")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise RequestFailed(f"model {model_id!r} exists already (model_seq_id {model_seq_id} was used)")
        tenant = f"tenant{next(self._tenant_ids)}"  # never reused: nor are its adapters' names
        self.sampling.add_tenant(tenant)
        self.models[model_id] = model = Model(model_id, tenant, rank)
        self.sessions[session_id].append(model_id)
        return model

    def _add_tenant(self, spec: TenantSpec, model_id: str) -> dict:
        self.policy.add(spec)
        log.info("model %s: tenant %s, rank %d, on %s", model_id, spec.name, spec.rank, ",".join(spec.target_modules))
        return {"model_id": model_id}

    def state_dir(self, path: str) -> Path:
        """Where the state at `path` (`tinker://<model id>/weights/<name>`, what `save_state` returned) lives."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights" or any(
                part in ("", ".", "..") for part in parts):
            raise RequestFailed(f"not a training state path: {path!r} (expected tinker://<model id>/weights/<name>)")
        return self.state_root / parts[0].replace(":", "_") / parts[2]

    def info(self, model_id: str) -> dict:
        model = self.model(model_id)
        return {"model_id": model_id, "is_lora": True, "lora_rank": model.rank, "model_name": self.base_model,
                "model_data": {"arch": "lora", "model_name": self.base_model, "tokenizer_id": self.tokenizer_id}}

    def model(self, model_id: str) -> Model:
        if (model := self.models.get(model_id)) is None:
            raise RequestFailed(f"unknown model {model_id!r}")
        return model

    def create_sampler(self, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """A sampling session of saved sampler weights (`model_path`) or of the base model."""
        self._session(session_id)
        if model_path is None:
            self._check_base(base_model)
        return self.sampling.create(model_path)

    def _check_base(self, base_model: str | None) -> None:
        if base_model not in (self.base_model, self.tokenizer_id):
            raise RequestFailed(f"base model {base_model!r} is not served; the service serves {self.base_model!r}")

    def _session(self, session_id: str) -> list[str]:
        if (models := self.sessions.get(session_id)) is None:
            raise RequestFailed(f"unknown session {session_id!r}")
        return models

    def _job(self, work) -> str:
        return self.futures.job(work)

    # ordered operations

    def submit(self, model_id: str, seq_id: int, kind: str, payload: Any) -> str:
        """Queue `kind` for `model_id` at its place `seq_id`; its request id.

        Raises:
            RequestFailed: an unknown model, or a sequence id already used.
        """
        model = self.model(model_id)
        if (issued := model.issued.get(seq_id)) is not None and issued[0] == kind:
            return issued[1]  # sent again, its answer lost (`_created`)
        if seq_id < model.next_seq or seq_id in model.waiting:
            raise RequestFailed(f"model {model_id!r}: seq_id {seq_id} was used already (next: {model.next_seq})")
        request_id, future = self.futures.new()
        model.waiting[seq_id] = Op(kind, seq_id, payload, future)
        model.issued[seq_id] = (kind, request_id)
        model.issued.pop(seq_id - ISSUED_KEPT, None)
        self._wake.set()
        return request_id

    def skip(self, model_id: str, seq_id: int) -> None:
        """Give up `seq_id`'s place in `model_id`'s order: its request was refused (a 400), and the
        client has counted it, so the operations after it must not wait for it."""
        model = self.models.get(model_id)
        if model is not None and seq_id >= model.next_seq and seq_id not in model.waiting:
            model.waiting[seq_id] = Op(SKIP, seq_id, None, asyncio.get_running_loop().create_future())
            self._wake.set()

    async def _schedule(self) -> None:
        """Run each model's next operation once its turn comes; forward_backward passes together."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            ready = self._take_ready(lambda op: op.kind != FORWARD_BACKWARD)
            for model, op in ready:
                asyncio.get_running_loop().create_task(self._run([model], [op], _listed(self._single(model, op))))
            passes = self._take_ready(lambda op: op.kind == FORWARD_BACKWARD)
            if passes and self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)
                passes += self._take_ready(lambda op: op.kind == FORWARD_BACKWARD)
            groups: dict[tuple[str, bool], list[tuple[Model, Op]]] = {}
            for model, op in passes:
                groups.setdefault((op.payload["loss"], op.payload["forward_only"]), []).append((model, op))
            for (loss, forward_only), group in groups.items():
                asyncio.get_running_loop().create_task(self._run_pass(group, loss, forward_only))

    def _take_ready(self, wanted: Callable[[Op], bool]) -> list[tuple[Model, Op]]:
        ready = []
        for model in self.models.values():
            if not model.busy and (op := model.waiting.get(model.next_seq)) is not None and wanted(op):
                del model.waiting[model.next_seq]
                model.busy = True
                ready.append((model, op))
        return ready

    async def _run(self, models: list[Model], ops: list[Op], work) -> None:
        """Await `work` (one result per op), resolve the ops' futures, then free the models for their next."""
        try:
            for op, result in zip(ops, await work, strict=True):
                op.future.set_result(result)
        except Exception as error:  # every failure reaches the client as its request's result
            failure = as_failure(error)
            for op in ops:
                op.future.set_exception(failure)
        finally:
            for model in models:
                model.next_seq += 1
                model.busy = False
            self._wake.set()

    async def _run_pass(self, group: list[tuple[Model, Op]], loss: str, forward_only: bool) -> None:
        models, ops = [model for model, _ in group], [op for _, op in group]
        datums = [datum for op in ops for datum in op.payload["datums"]]
        counts = [len(op.payload["datums"]) for op in ops]

        def one_pass() -> list[ForwardResult]:
            results = self.policy.forward_backward(datums, loss, backward=not forward_only)
            starts = list(itertools.accumulate(counts, initial=0))
            return [ForwardResult(results[start:end]) for start, end in itertools.pairwise(starts)]

        log.debug("one pass for %d tenant(s): %d datums, %s", len(ops), len(datums), loss)
        self.pass_sizes[len(ops)] += 1
        await self._run(models, ops, self.run_on_model(one_pass))

    async def _single(self, model: Model, op: Op) -> Any:
        if op.kind == SKIP:
            return None
        if op.kind == OPTIM_STEP:
            return await self.run_on_model(functools.partial(self._optim_step, model, op.payload))
        if op.kind == SAVE_STATE:
            path = f"tinker://{model.model_id}/weights/{op.payload['name']}"
            await self.run_on_model(functools.partial(save_tenant, self.policy, model.tenant, self.state_dir(path),
                                                      overwrite=op.payload["overwrite"]))
            return {"path": path}
        if op.kind == LOAD_STATE:
            state_dir = self.state_dir(op.payload["path"])
            await self.run_on_model(functools.partial(load_tenant, self.policy, model.tenant, state_dir,
                                                      with_optimizer=op.payload["optimizer"]))
            return {"path": op.payload["path"], "model_id": model.model_id}
        if op.kind == SAVE_FOR_SAMPLER:
            source = TenantSource(self.policy, model.tenant, self.run_on_model)
            return await self.sampling.publish(source, model.model_id, op.payload)
        raise RequestFailed(f"unknown operation {op.kind!r}", "server")

    def _optim_step(self, model: Model, adam: AdamParams) -> dict:
        step = self.policy.optim_step(model.tenant, adam)
        if not step.applied:
            raise RequestFailed(f"optim_step of model {model.model_id!r} refused: {step.refused}")
        return {"metrics": {"grad_norm": step.grad_norm}}

async def _listed(work) -> list:
    return [await work]
