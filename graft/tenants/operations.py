"""What a model's turn runs, other than forward_backward: `ModelOperations`.

The scheduler (graft.tenants.schedule) decides when a model's operation runs; forward_backward passes
it runs itself, several tenants together. Every other operation is one tenant's alone, and runs here:
`optim_step`, `save_weights` / `load_weights` (a training state: adapter and optimizer, under the
owner's directory of the state root, graft.tenants.checkpoint) and `save_weights_for_sampler` (a
version published to the engine, graft.tenants.sampling). Model work runs on the service's model
thread (`run_on_model`), one job at a time.

Saved states live under `<state root>/<user>/<model id>/<name>`, whatever a client's `tinker://` path
names, so a user reaches their own states only.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from graft.tenants.checkpoint import TenantCheckpointError, load_tenant, save_tenant
from graft.tenants.futures import NotFound, RequestFailed
from graft.tenants.policy import AdamParams, TenantPolicy
from graft.tenants.sampling import Samplers
from graft.tenants.schedule import SKIP, Model, QueuedOperation
from graft.tenants.source import TenantSource

T = TypeVar("T")

OPTIM_STEP, SAVE_FOR_SAMPLER = "optim_step", "save_weights_for_sampler"
SAVE_STATE, LOAD_STATE = "save_weights", "load_weights"


class ModelOperations:
    """Runs a model's operations but forward_backward (the scheduler's `single`), and places users'
    saved states (module docstring).

    Args:
        policy: the tenants' adapters on the shared base.
        sampling: publishes tenants' versions for sampling.
        state_root: where users' training states are saved.
        run_on_model: runs a function on the model's thread, after the jobs before it.
        source: makes the `PolicySource` a publish reads (`TenantSource`; on ranks, graft.tenants.ranks').
    """

    def __init__(self, policy: TenantPolicy, sampling: Samplers, state_root: Path,
                 run_on_model: Callable[[Callable[[], T]], Awaitable[T]], source=TenantSource) -> None:
        self.policy = policy
        self.source = source
        self.sampling = sampling
        self.state_root = state_root
        self.run_on_model = run_on_model

    def state_dir(self, owner: str, path: str) -> Path:
        """Where `owner`'s state at `path` (`tinker://<model id>/weights/<name>`, what `save_state`
        returned) lives: under the user's own directory, whatever the path names."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights" or any(
                part in ("", ".", "..") or part.startswith(".") for part in parts):
            raise RequestFailed(f"not a training state path: {path!r} (expected tinker://<model id>/weights/<name>)")
        return self.state_root / owner / parts[0].replace(":", "_") / parts[2]

    def saved_state(self, owner: str, path: str) -> Path:
        """`state_dir`, which must hold a saved state.

        Raises:
            NotFound: none there (never saved, or another user's: they answer alike).
        """
        state_dir = self.state_dir(owner, path)
        if not state_dir.is_dir():
            raise NotFound(f"no saved state at {path!r}")
        return state_dir

    @staticmethod
    def checked(path: str, state_dir: Path, read: Callable[[], T]) -> T:
        """`read()`, a checkpoint problem told by the client's `path`, not the server's directories."""
        try:
            return read()
        except TenantCheckpointError as error:
            raise RequestFailed(str(error).replace(str(state_dir), path)) from None

    async def run(self, model: Model, op: QueuedOperation) -> Any:
        """Run `model`'s operation `op` (any but forward_backward, which the scheduler runs in passes)."""
        if op.kind == SKIP:
            return None
        if op.kind == OPTIM_STEP:
            return await self.run_on_model(functools.partial(self._optim_step, model, op.payload))
        if op.kind == SAVE_STATE:
            path = f"tinker://{model.model_id}/weights/{op.payload['name']}"
            state_dir = self.state_dir(model.owner, path)
            if state_dir.exists() and not op.payload["overwrite"]:
                raise RequestFailed(f"a state is saved at {path!r} already; pass overwrite=True to replace it")
            await self.run_on_model(functools.partial(save_tenant, self.policy, model.tenant, state_dir,
                                                      overwrite=True))
            return {"path": path}
        if op.kind == LOAD_STATE:
            path = op.payload["path"]
            state_dir = self.saved_state(model.owner, path)
            await self.run_on_model(lambda: self.checked(path, state_dir, lambda: load_tenant(
                self.policy, model.tenant, state_dir, with_optimizer=op.payload["optimizer"])))
            return {"path": path, "model_id": model.model_id}
        if op.kind == SAVE_FOR_SAMPLER:
            source = self.source(self.policy, model.tenant, self.run_on_model)
            return await self.sampling.publish(model.owner, source, model.model_id, op.payload)
        raise RequestFailed(f"unknown operation {op.kind!r}", "server")

    def _optim_step(self, model: Model, adam: AdamParams) -> dict:
        step = self.policy.optim_step(model.tenant, adam)
        if not step.applied:
            raise RequestFailed(f"optim_step of model {model.model_id!r} refused: {step.refused}")
        return {"metrics": {"grad_norm": step.grad_norm}}
