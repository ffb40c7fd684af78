"""The Tinker service's state: `TenantService`, its users' sessions, models and saved states.

Sessions own training models (one tenant each: its own LoRA adapter and optimizer on the shared
base, `graft.tenants.policy`) and sampling sessions (a tenant's published version, or the base).
Models' operations run in each model's order, forward_backward passes of several tenants together
(graft.tenants.schedule), the others one at a time (graft.tenants.operations). All model work runs
on one thread, one job at a time; HTTP handling, sampling and adapter syncs run on the event loop
beside it.

Users: every session, model, sampling session, request and saved state belongs to the user whose key
made it (graft.tenants.users). A lookup of another user's id or `tinker://` path fails exactly as a
lookup of one that never existed (`NotFound`): nothing tells one user what another holds. Ids are
random, so none is reused, also across restarts (a new client must never get a crashed service's
model id, whose saved states it could then overwrite). Saved states live under
`<state root>/<user>/<model id>/<name>` (graft.tenants.operations), so a restarted service on the
same root serves each to its owner and to no one else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from graft.atomic import sweep_temporaries
from graft.tenants.checkpoint import load_tenant, tenant_spec
from graft.tenants.futures import Futures, NotFound, RequestFailed
from graft.tenants.operations import ModelOperations
from graft.tenants.parse import Bounds
from graft.tenants.policy import TenantPolicy, TenantSpec
from graft.tenants.sampling import Samplers
from graft.tenants.schedule import Model, Scheduler
from graft.tenants.source import TenantSource

log = logging.getLogger(__name__)
T = TypeVar("T")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Session:
    """A client's session: its user, its training models' ids, when it was last heard from."""

    owner: str
    heard: float
    models: list[str] = field(default_factory=list)
    finished: bool = False


class TenantService:
    """The Tinker API's model over a `TenantPolicy` (module docstring).

    Args:
        policy: the tenants' adapters on the shared base.
        serving: publishes tenants' versions to the engine and samples (graft.tenants.serving); None:
            training only.
        base_model: the name clients give to create models and that `get_info` reports.
        tokenizer_id: what clients load the tokenizer from (`get_info`'s `tokenizer_id`).
        max_rank: the largest LoRA rank the engine serves.
        state_root: where `save_state` writes users' states (graft.tenants.checkpoint).
        bounds: the base's vocabulary and context, and what one user or request may take
            (graft.tenants.parse, graft.tenants.users).
        batch_window_s: how long a forward_backward waits for other tenants' passes to join it.
        session_timeout_s: a session not heard from for this long (the SDK sends a heartbeat every
            10 s while its client lives) is finished as if its client had closed it: a client that
            died without closing would otherwise hold its tenants' engine slots for good.
        source: makes the source a tenant's publish reads (`ModelOperations`).
    """

    def __init__(self, policy: TenantPolicy, serving, *, base_model: str, tokenizer_id: str, max_rank: int,
                 state_root: Path, bounds: Bounds, batch_window_s: float = 10.0,
                 session_timeout_s: float = 300.0, source=TenantSource) -> None:
        self.policy = policy
        self.state_root = state_root
        self.base_model = base_model
        self.tokenizer_id = tokenizer_id
        self.max_rank = max_rank
        self.bounds = bounds
        self.limits = bounds.limits
        self.futures = Futures()
        self.sessions: dict[str, Session] = {}
        self.session_timeout_s = session_timeout_s
        self.sampling = Samplers(serving, self.futures, self.limits.engine_per_user)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="graft-tenants-model")
        self.operations = ModelOperations(policy, self.sampling, state_root, self.run_on_model, source)
        # where users' states live: asked of the service by graft.tenants.rest (and tests)
        self.state_dir, self.saved_state = self.operations.state_dir, self.operations.saved_state
        self.scheduler = Scheduler(policy, self.futures, self.run_on_model, self.operations.run, batch_window_s)
        self.models: dict[str, Model] = self.scheduler.models
        self.pass_sizes = self.scheduler.pass_sizes
        self._tasks: list[asyncio.Task] = []

    async def run_on_model(self, job: Callable[[], T]) -> T:
        """`job()` on the model's thread, after the jobs before it (timed: the scheduler's `clock`)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.scheduler.clock.timed(job))

    def start(self) -> None:
        """Start scheduling operations (on the running event loop), after removing what saves cut
        short by a crash left behind (never a state: those appear whole or not at all)."""
        for leftover in sweep_temporaries(self.state_root) if self.state_root.exists() else ():
            log.info("removed %s, left by a save that did not finish", leftover)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.scheduler.run()), loop.create_task(self._expire_silent_sessions())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.sampling.close()
        self._thread.shutdown(wait=True)

    # sessions and models

    def create_session(self, owner: str) -> str:
        live = sum(1 for session in self.sessions.values() if session.owner == owner and not session.finished)
        if live >= self.limits.sessions_per_user:
            raise RequestFailed(f"you hold {live} live sessions, the limit per user (--max-sessions); "
                                "finish one (close its ServiceClient) first")
        session_id = f"session-{secrets.token_hex(8)}"
        self.sessions[session_id] = Session(owner, time.monotonic())
        return session_id

    def heartbeat(self, owner: str, session_id: str) -> bool:
        """Note that `session_id`'s client lives; False when the session is finished (or not the user's)."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner or session.finished:
            return False
        session.heard = time.monotonic()
        return True

    async def _expire_silent_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.session_timeout_s / 2))
            now = time.monotonic()
            for session_id, session in list(self.sessions.items()):
                if now - session.heard > self.session_timeout_s and not session.finished:
                    log.warning("session %s sent no heartbeat for %.0f s: finished, its tenants released",
                                session_id, now - session.heard)
                    await self._finish(session_id)

    async def finish_session(self, owner: str, session_id: str) -> None:
        """End `owner`'s session: once each of its models' queued operations are done, its tenant goes
        (versions unloaded, engine slots and the adapter's memory freed) and its id is unknown from then on."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"unknown session {session_id!r}")
        await self._finish(session_id)

    async def _finish(self, session_id: str) -> None:
        session = self.sessions[session_id]
        if session.finished:
            return  # a retried finish (the SDK resends one whose answer it did not get)
        session.finished = True
        for model_id in session.models:
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

    def create_model(self, owner: str, session_id: str, model_seq_id: int, base_model: str, *, rank: int,
                     seed: int | None, train_attn: bool, train_mlp: bool) -> str:
        """A new tenant of `owner`'s (the SDK's LoraConfig); a request id whose result is `{"model_id"}`.
        A tenant's alpha is its rank (LoRA scaling 1); `train_unembed` is not supported and ignored (the
        adapter covers attention and MLP).

        Raises:
            RequestFailed: an unknown session or base model, a rank the engine cannot serve, no LoRA
                target asked for, or the user's models at their limit.
        """
        if (retried := self._created(owner, session_id, model_seq_id)) is not None:
            return retried
        self._check_base(base_model)
        targets = (ATTENTION if train_attn else ()) + (MLP if train_mlp else ())
        if not targets:
            raise RequestFailed("train_attn and train_mlp are both false: the adapter would train nothing")
        model = self._new_model(owner, session_id, model_seq_id, rank)
        spec = TenantSpec(model.tenant, rank=rank, alpha=float(rank), target_modules=targets,
                          seed=len(self.models) if seed is None else seed)
        model.created_by = self.futures.job(owner, self.run_on_model(functools.partial(self._add_tenant, spec, model)))
        return model.created_by

    def create_model_from_state(self, owner: str, session_id: str, model_seq_id: int, path: str,
                                with_optimizer: bool) -> str:
        """A new tenant of `owner`'s whose adapter (and optimizer, `with_optimizer`) is `owner`'s state
        saved at `path`."""
        if (retried := self._created(owner, session_id, model_seq_id)) is not None:
            return retried
        state_dir = self.saved_state(owner, path)
        spec = self.operations.checked(path, state_dir, lambda: tenant_spec(state_dir, ""))
        model = self._new_model(owner, session_id, model_seq_id, spec.rank)

        def add_and_load() -> dict:
            self._add_tenant(dataclasses.replace(spec, name=model.tenant), model)
            self.operations.checked(path, state_dir, lambda: load_tenant(self.policy, model.tenant, state_dir,
                                                                         with_optimizer=with_optimizer))
            return {"path": path, "model_id": model.model_id}

        model.created_by = self.futures.job(owner, self.run_on_model(add_and_load))
        return model.created_by

    def _created(self, owner: str, session_id: str, model_seq_id: int) -> str | None:
        """The request id of the session's model `model_seq_id` if it was created already. The SDK sends
        a request again when its answer was lost (a timeout: under a full test run's load a cookbook
        recipe's first save_weights_for_sampler was refused so, which failed the run), and the same
        request gets the same answer here and in `Scheduler.submit`."""
        model = self.models.get(f"{session_id}:train:{model_seq_id}")
        return None if model is None or model.owner != owner else model.created_by

    def _new_model(self, owner: str, session_id: str, model_seq_id: int, rank: int) -> Model:
        session = self.user_session(owner, session_id)
        if not 1 <= rank <= self.max_rank:
            raise RequestFailed(f"LoRA rank {rank} is out of range: the engine here serves ranks 1..{self.max_rank}")
        held = sum(1 for model in self.models.values() if model.owner == owner)
        if held >= self.limits.models_per_user:
            raise RequestFailed(f"you hold {held} training models, the limit per user (--max-models); finish a "
                                "session that holds one first")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise RequestFailed(f"model {model_id!r} exists already (model_seq_id {model_seq_id} was used)")
        tenant = f"t{secrets.token_hex(6)}"  # never reused: nor are its adapters' names
        self.sampling.add_tenant(tenant)
        self.models[model_id] = model = Model(model_id, owner, tenant, rank)
        session.models.append(model_id)
        return model

    def _add_tenant(self, spec: TenantSpec, model: Model) -> dict:
        self.policy.add(spec)
        log.info("model %s of %s: tenant %s, rank %d, on %s", model.model_id, model.owner, spec.name, spec.rank,
                 ",".join(spec.target_modules))
        return {"model_id": model.model_id}

    def info(self, owner: str, model_id: str) -> dict:
        model = self.model(owner, model_id)
        return {"model_id": model_id, "is_lora": True, "lora_rank": model.rank, "model_name": self.base_model,
                "model_data": {"arch": "lora", "model_name": self.base_model, "tokenizer_id": self.tokenizer_id}}

    def model(self, owner: str, model_id: str) -> Model:
        if (model := self.models.get(model_id)) is None or model.owner != owner:
            raise NotFound(f"unknown model {model_id!r}")
        return model

    def create_sampler(self, owner: str, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """A sampling session of `owner`'s saved sampler weights (`model_path`) or of the base model."""
        self.user_session(owner, session_id)
        if model_path is None:
            self._check_base(base_model)
        return self.sampling.create(owner, model_path)

    def _check_base(self, base_model: str | None) -> None:
        if base_model not in (self.base_model, self.tokenizer_id):
            raise RequestFailed(f"base model {base_model!r} is not served; the service serves {self.base_model!r}")

    def user_session(self, owner: str, session_id: str) -> Session:
        """`owner`'s live session `session_id`.

        Raises:
            NotFound: none such (finished, never made, or another user's).
        """
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner or session.finished:
            raise NotFound(f"unknown session {session_id!r}")
        return session

    # ordered operations

    def submit(self, owner: str, model_id: str, seq_id: int, kind: str, payload: Any) -> str:
        """Queue `kind` for `owner`'s model `model_id` at its place `seq_id`; its request id.

        Raises:
            RequestFailed: an unknown model, or a sequence id already used.
        """
        return self.scheduler.submit(self.model(owner, model_id), seq_id, kind, payload)

    def skip(self, owner: str, model_id: str, seq_id: int) -> None:
        """Give up `seq_id`'s place in `owner`'s model's order (`Scheduler.skip`)."""
        if (model := self.models.get(model_id)) is not None and model.owner == owner:
            self.scheduler.skip(model, seq_id)
