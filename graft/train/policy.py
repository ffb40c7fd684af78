"""The trained policy on one rank: the LoRA model (FSDP2-sharded over ranks), what the sync reads of
it (`source`), the optimizer, and where the run stands — created fresh or resumed.

No rank holds the model whole: rank 0 keeps its shard and the LoRA tensors gathered after each step,
and the sync reads the rest through collectives (`graft.train.ranks`). Rank 0's loop
(`graft.train.trainer`) calls `learn` and `maybe_checkpoint` and syncs through `source`; each of
those announces its collective, and the other ranks, in `follow`, run the same calls in the same order.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from graft.config import GraftConfig
from graft.lora.attach import lora_parameters
from graft.lora.policy import build_policy
from graft.parallel.abandon import stop_points
from graft.parallel.dist import Dist, full_tensor
from graft.parallel.parallelize import parallelize
from graft.sync.source import ModelSource, PolicySource
from graft.train.batch_broadcast import broadcast_batch
from graft.train.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from graft.train.lr_schedule import learning_rate
from graft.train.ranks import Op, ShardedSource, announce, follow
from graft.train.rollout_batch import RolloutBatch
from graft.train.update import policy_update

log = logging.getLogger(__name__)


class ResumeError(ValueError):
    """`--resume` without a checkpoint, or a fresh start over an earlier run's checkpoints."""


def refuse_fresh_start_over_checkpoints(run_dir: Path) -> None:
    """A fresh run must not mix with an earlier run's checkpoints (called before anything is written).

    Raises:
        ResumeError: RUN_DIR/checkpoints holds a checkpoint.
    """
    found = latest_checkpoint(run_dir / "checkpoints")
    if found is not None:
        raise ResumeError(f"{run_dir} holds checkpoints of an earlier run ({found.name}): pass --resume to "
                          "continue it, or choose another --run-dir")


class PolicyState:
    """Model, sync source, optimizer and the run's position on one rank.

    `version` is the policy's version: the updates applied so far, so version N is the policy after
    step N (what step N + 1 trains on and syncs come from). It is the one holder of the trained
    version; the version the engines serve is `graft.sync.policy_sync.PolicySync.served`.

    Args:
        pad_id: the tokenizer's pad token (batches are right-padded with it).
        resume: continue from the newest checkpoint in RUN_DIR/checkpoints.

    Raises:
        ResumeError: `resume` without a checkpoint that loads.
    """

    def __init__(self, config: GraftConfig, run_dir: Path, ctx: Dist, pad_id: int, resume: bool) -> None:
        self.config, self.ctx, self.pad_id = config, ctx, pad_id
        self.checkpoints = run_dir / "checkpoints"
        self.model = build_policy(config.model, config.lora, config.train.seed).to(ctx.device)
        parallelize(self.model, ctx, activation_checkpointing=config.train.activation_checkpointing,
                    lora_compute_dtype=config.train.lora_compute_dtype, compile_layers=config.train.compile)
        self._stopping = stop_points(self.model)
        # What the sync publishes and verifies (rank 0): with one rank the model itself; sharded, the
        # LoRA weights gathered after each step (a LoRA-only gather) plus collectives for the rest.
        self._lora: dict[str, torch.Tensor] = {}
        self.source: PolicySource = ShardedSource(self.model, self._lora) if ctx.active else ModelSource(self.model)
        self.optimizer = torch.optim.AdamW(lora_parameters(self.model).values(), lr=config.train.lr,
                                           weight_decay=config.train.weight_decay)
        self.version = 0
        if resume:  # a fresh start over checkpoints is refused by the caller, before it writes anything
            self._resume()
        self._gather_for_publishing()

    def _resume(self) -> None:
        """Load the newest checkpoint that loads; a damaged one (a crash or a full disk while it was
        written elsewhere) is reported and the one before it is used."""
        found = complete_checkpoints(self.checkpoints)
        if not found:
            raise ResumeError(f"--resume: no checkpoint in {self.checkpoints}")
        for path in found:
            try:
                state = load_checkpoint(path, self.model, self.optimizer)
            except CheckpointError as error:  # nothing was changed: try the previous one
                log.warning("skipping checkpoint %s: %s", path.name, error)
                continue
            self.version = state["policy_version"]
            return
        raise ResumeError(f"--resume: no checkpoint in {self.checkpoints} loads (see the warnings above)")

    def learn(self, batch: RolloutBatch | None, step: int) -> dict:
        """Broadcast rank 0's batch, update on this rank's slice, gather the LoRA weights for
        publishing; the step's train metrics. `batch` is None on ranks > 0."""
        self._announce(Op.LEARN, step)
        batch = broadcast_batch(batch, self.ctx)
        lr = learning_rate(self.config, step)
        for group in self.optimizer.param_groups:  # the config's, also over a resumed checkpoint's
            group.update(lr=lr, weight_decay=self.config.train.weight_decay)
        metrics = policy_update(self.model, self.optimizer, batch, self.config.train, self.pad_id, self.ctx, step)
        self._gather_for_publishing()
        self.version = step
        return {**metrics, "lr": lr}

    def abandon(self) -> None:
        """The run is stopping: an update (or a check's forward) running on another thread ends at its
        next decoder layer with `graft.parallel.abandon.Abandoned`; the model is not used again."""
        self._stopping.set()

    def _gather_for_publishing(self) -> None:
        """A collective (all-gather of each LoRA shard) on every rank; rank 0 keeps the result."""
        if not self.ctx.active:
            return
        with torch.no_grad():
            for name, param in lora_parameters(self.model).items():
                full = full_tensor(param.detach())
                if self.ctx.is_main:
                    self._lora[name] = full

    def maybe_checkpoint(self, step: int) -> None:
        """Save RUN_DIR/checkpoints/step-N every `train.checkpoint_every` steps and at the last."""
        self._announce(Op.CHECKPOINT, step)
        train = self.config.train
        if step == train.steps or (train.checkpoint_every and step % train.checkpoint_every == 0):
            save_checkpoint(self.checkpoints, self.model, self.optimizer,
                            {"step": step, "policy_version": self.version, "data_cursor": step * train.batch_prompts},
                            step=step, keep=train.keep_checkpoints, write=self.ctx.is_main)

    def _announce(self, op: Op, *args: int) -> None:
        """Rank 0 of a sharded run: the other ranks (in `follow`) join this call next."""
        if self.ctx.active and self.ctx.is_main:
            announce(op, *args)

    def follow(self) -> None:
        """Ranks > 0: join rank 0's collectives (updates, checkpoints, the sync's reads of the sharded
        model), in the order it announces them, until it calls `release_followers` (`graft.train.ranks`)."""
        follow(self)

    def release_followers(self) -> None:
        """Rank 0, when its loop is done: the other ranks leave `follow`. Only called between
        collectives (after an error mid-collective rank 0 exits instead, and torchrun stops the rest)."""
        self._announce(Op.STOP)
