"""The LoRA GRPO loop: rollout → rewards → group advantages → one policy update → sync the new
version into the engines (verified) → metrics, checkpoints, evaluations.

    graft train configs/quickstart.yaml --run-dir runs/demo            # one process
    torchrun --nproc-per-node 2 -m graft.cli train CONFIG --run-dir R  # FSDP2 over 2 ranks

Where each part lives: the policy, optimizer and resume in `graft.train.policy`; the update in
`graft.train.update`; how a step's batch is made in `graft.train.batch_maker`; the bound on how far
rollouts run ahead in `graft.train.staleness`; the sync in `graft.sync.policy_sync`.

Rollouts come from a `RolloutProducer` that runs ahead of the trainer by at most
`rollout.max_staleness` versions (0 = rollout and update alternate); the update runs in a worker
thread so the engines keep generating meanwhile. Rank 0 owns the engines, the sync and the run
directory; the other ranks take their slice of each batch (see `graft.parallel.dist`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from graft.config import GraftConfig, save_config
from graft.evaluation import evaluate
from graft.host import leave_a_core_to_local_vllm, release_cached_memory, set_up_host_memory
from graft.lora.attach import count_parameters
from graft.models.loading import load_hf_config
from graft.parallel.dist import init_distributed, shutdown_distributed
from graft.parallel.parallelize import check_tensor_parallel
from graft.rollout.engine import EngineError, RolloutEngine
from graft.rollout.episodes import EpisodeLimits, evaluate_episodes
from graft.rollout.factory import open_engine
from graft.sync.owner import LockHeldError, hold_lock
from graft.sync.policy_sync import PolicySync
from graft.sync.source import SnapshotSource
from graft.train.batch_maker import BatchMaker, TrainTask, load_train_task
from graft.train.metrics import MetricsLog
from graft.train.policy import PolicyState, ResumeError, refuse_fresh_start_over_checkpoints
from graft.train.rollout_batch import RolloutBatch
from graft.train.staleness import RolloutProducer

__all__ = ["ResumeError", "RunDirError", "train"]

# How long a run that stops early spends unloading its older adapter versions (a few HTTP calls, tens
# of ms on a server that answers): a stopped run has ~10 s in all before docker's SIGKILL.
_EXIT_UNLOAD_TIMEOUT_S = 3.0

T = TypeVar("T")


@dataclass(frozen=True)
class _Checking:
    """A synced step whose delivery check is still running: `check` gives the sync metrics, `row`
    turns them into the step's metrics row."""

    check: asyncio.Future
    row: Callable[[dict], dict]
    version: int


class _Leader:
    """Rank 0's loop: the engines, the sync, the run directory, around the policy's collectives."""

    def __init__(self, config: GraftConfig, run_dir: Path, policy: PolicyState, task: TrainTask,
                 engine: RolloutEngine) -> None:
        self.config, self.run_dir, self.policy, self.task, self.engine = config, run_dir, policy, task, engine
        self.sync = PolicySync(config, engine, run_dir)
        self.batches = BatchMaker(config, engine, self.sync, task)
        self._checking: _Checking | None = None
        # Every job that reads or changes the model (updates, checkpoints, a check's snapshot reads)
        # runs here, one at a time.
        self._model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graft-model")

    async def _on_model_thread(self, job: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, job)

    async def run(self) -> dict:
        config, train, policy, sync = self.config, self.config.train, self.policy, self.sync
        held_out = "held-out reward (greedy episodes)" if self.task.env is not None else "held-out accuracy (greedy)"
        self.log = MetricsLog(self.run_dir, keep_through_step=policy.version, held_out=held_out)
        first_step = policy.version + 1
        try:
            sync.discard_from(policy.version)  # what an earlier (interrupted) run published from here on
            await sync(policy.source, policy.version, step=policy.version)
            await sync.served.release(policy.version)
            if first_step == 1:
                self.log.add_eval(0, await self._evaluate())
            trainable, total = count_parameters(policy.model)
            print(f"policy: {trainable:,} trainable LoRA parameters on a frozen base, {total:,} in all "
                  f"({100 * trainable / total:.2f}%); sync mode {sync.mode.name}, {sync.check_summary()}")
            producer = RolloutProducer(self.batches.make, served=sync.served, first_step=first_step,
                                       last_step=train.steps, max_staleness=config.rollout.max_staleness)
            async with producer:
                with _progress() as progress:
                    bar = progress.add_task("train", total=train.steps, completed=policy.version, reward=0.0, sync=0.0)
                    self._last = time.perf_counter()
                    for step in range(first_step, train.steps + 1):
                        reward, sync_seconds = await self._step(step, producer)
                        progress.update(bar, completed=step, reward=reward, sync=sync_seconds)
                    await self._checked()
            self.log.add_eval(train.steps, await self._evaluate())
            await sync.close()
        except BaseException:
            # First, before any await: an update running on the model thread ends at its next layer
            # (`graft.parallel.abandon`) instead of being waited for in the `finally` below (a SIGTERM'd
            # SmolLM2 run waited 28 s there), and is never applied: nothing is published or saved after.
            policy.abandon()
            await self._stop_checking()
            await self._leave_last_good_served()
            raise
        finally:
            self.log.close()
            self._model_thread.shutdown(wait=True)  # a check's snapshot read restores the model before we return
        return {"accuracy_before": self.log.accuracy_at(0), "accuracy_after": self.log.accuracy_at(train.steps),
                "steps": train.steps, "resumed_from": first_step - 1}

    async def _stop_checking(self) -> None:
        """A run that did not finish ends its running delivery check before it unloads: the check would
        probe a version the unload removes, and its error (the version "does not exist") came out of
        a SIGTERM'd run as a traceback of a task nobody read."""
        pending, self._checking = self._checking, None
        if pending is not None:
            pending.check.cancel()
            await asyncio.gather(pending.check, return_exceptions=True)

    async def _leave_last_good_served(self) -> None:
        """A run that did not finish (an error, Ctrl-C, SIGTERM) leaves its last good version served,
        as a server must keep serving it, and unloads the older versions of its retention window, so
        a user's server does not hold them until the next run with this lora.name (which unloads the
        last one, graft.sync.adapter). Best effort and bounded: the server may be why the run stopped."""
        try:
            await asyncio.wait_for(self.sync.close(keep_last_good=True), _EXIT_UNLOAD_TIMEOUT_S)
        except (Exception, asyncio.CancelledError) as error:  # the run's own error is the one to report
            logging.getLogger(__name__).warning("older adapter versions may still be loaded: %r", error)

    async def _step(self, step: int, producer: RolloutProducer) -> tuple[float, float]:
        """Batch → update → sync → checkpoint, the sync's delivery check left running (its metrics
        row is written when it ends); (reward mean, sync seconds without the check)."""
        policy, sync, train = self.policy, self.sync, self.config.train
        try:
            batch = await producer.get(step)
        except EngineError:
            # The batch is sampled from the version the check is still probing: a failed check says why
            # its rollout failed better than the rollout's own error (e.g. a load that missed an engine,
            # where the rollout's request for that version answers "does not exist").
            await self._checked()
            raise
        await self._checked(through=batch.version)  # a batch is learned from once its version passed (below)
        train_metrics = await self._on_model_thread(functools.partial(policy.learn, batch, step))
        await self._checked()  # its trainer side ran right after that update: the sync reads the live model
        # A sync that changes what running requests compute (a merged reload) must not land in the
        # middle of a batch: its samples would mix two versions.
        lock = producer.engine_lock if sync.mode.needs_engine_lock else contextlib.nullcontext()
        async with lock:
            applied = await sync.apply(policy.source, step, step=step)
        # The next rollout starts on the new version now and the delivery check runs beside it (the
        # probe shares the engine's steps with the rollout; measured at 25M parameters: verifying
        # first took 0.27 s of a 0.30 s sync). A batch of this version is learned from only once the
        # check has passed (`_checked(through=...)` before `learn`); an older batch (overlapped runs)
        # is learned from meanwhile: the check reads this version's weights from a snapshot, on the
        # model thread between updates (`SnapshotSource`; waiting for it cost the overlapped
        # quickstart step 19%, `graft bench verify`). Sharded, its forward is a collective, so it
        # ends before the checkpoint's begin.
        snapshot = SnapshotSource(policy.model, self._on_model_thread) if sync.verify and not policy.ctx.active \
            else None  # the copy of the LoRA values only where a check will read it
        check = asyncio.ensure_future(sync.confirm(applied, snapshot))
        if policy.ctx.active:
            await asyncio.wait([check])
        await sync.served.release(step)
        await self._on_model_thread(functools.partial(policy.maybe_checkpoint, step))
        now = time.perf_counter()
        row = functools.partial(_row, step, batch, train_metrics, dropped=producer.dropped,
                                step_seconds=now - self._last)
        self._checking, self._last = _Checking(check, row, step), now
        if train.eval_every and step % train.eval_every == 0 and step != train.steps:
            await self._checked()
            self.log.add_eval(step, await self._evaluate())
            self._last = time.perf_counter()  # step_seconds measure training, not evaluation
        return batch.rewards_PG.mean().item(), applied.result.seconds

    async def _checked(self, through: int | None = None) -> None:
        """Wait for the running delivery check, if any (with `through`: only if it checks a version up
        to that one), and write its step's metrics row; a failed check raises here."""
        pending = self._checking
        if pending is None or (through is not None and pending.version > through):
            return
        checked = await pending.check  # still `_checking` while it runs: a run that stops ends it (`_stop_checking`)
        self._checking = None
        self.log.write(pending.row(checked))

    async def _evaluate(self) -> float:
        """Held-out accuracy (or mean episode reward) of the policy's current version."""
        adapter, task = self.sync.request_adapter(self.policy.version), self.task
        if task.env is not None:
            return await evaluate_episodes(self.engine, adapter, task.env, task.eval_set, task.tokenizer,
                                           self.config.rollout.max_new_tokens, EpisodeLimits.of(self.config))
        return await evaluate(self.engine, adapter, task.eval_set, task.tokenizer, self.config.rollout.max_new_tokens,
                              task.eval_scorer, task.prompts)


def _progress() -> Progress:
    return Progress(TextColumn("GRPO"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                    TextColumn("reward {task.fields[reward]:.2f}  sync {task.fields[sync]:.2f}s"),
                    TimeRemainingColumn())


def _row(step: int, batch: RolloutBatch, train_metrics: dict, sync_metrics: dict, dropped: int,
         step_seconds: float) -> dict:
    """One metrics.jsonl row (every key of the run-directory contract, and a few more)."""
    return {
        "step": step, "reward_mean": batch.rewards_PG.mean().item(), "reward_std": batch.rewards_PG.std().item(),
        **train_metrics, **sync_metrics,
        "rollout_seconds": batch.seconds, "rollout_tokens": batch.tokens,
        "rollout_tokens_per_s": batch.tokens / batch.seconds if batch.seconds else 0.0,
        "rollout_version": batch.version, "staleness_max": step - 1 - batch.version, "dropped_stale_batches": dropped,
        "step_seconds": step_seconds, **batch.reward_metrics,
        "truncated_fraction": sum(batch.truncated) / len(batch.sequences),
    }


async def train(config: GraftConfig, run_dir: str | Path, *, resume: bool = False) -> dict:
    """Run GRPO to `config.train.steps` (from the latest checkpoint with `resume`).

    Returns (rank 0): held-out accuracy before and after, the steps, and where it resumed from;
    other ranks return {}.

    Raises:
        ResumeError: `resume` without a checkpoint, or a fresh run over an earlier run's checkpoints.
        ConfigError: model.path is not set.
        ValueError: a `dist.tp` the model or the world size cannot be split by.
    """
    config.require_model_path("train")
    with leave_a_core_to_local_vllm(config):
        return await _train(config, Path(run_dir), resume)


async def _train(config: GraftConfig, run_dir: Path, resume: bool) -> dict:
    set_up_host_memory(config.train)
    if config.dist.tp > 1:  # before any process group work: every rank fails alike, at once
        check_tensor_parallel(load_hf_config(config.model.path), config.dist.tp, config.lora.target_modules,
                              config.lora.dropout)
    ctx = init_distributed(config.dist.backend, config.dist.tp)
    try:
        with _run_dir_lock(run_dir) if ctx.is_main else contextlib.nullcontext():
            torch.manual_seed(config.train.seed)
            if not resume:  # every rank, before anything is written: a refused start changes nothing
                refuse_fresh_start_over_checkpoints(run_dir)
            task = load_train_task(config)
            policy = PolicyState(config, run_dir, ctx, task.tokenizer.pad_token_id, resume)
            if not ctx.is_main:
                policy.follow()  # the collectives rank 0 announces: updates, checkpoints, the sync's reads
                return {}
            save_config(config, run_dir / "config.yaml")  # once a resume loaded: a refused one leaves it as it was
            async with open_engine(config, run_dir) as engine:
                result = await _Leader(config, run_dir, policy, task, engine).run()
            policy.release_followers()
            return result
    finally:
        shutdown_distributed(ctx)
        release_cached_memory()  # the run's cached update memory: a process that goes on (a bench) gets it back


class RunDirError(ValueError):
    """The run directory cannot be used: not a directory, or in use by another graft process."""


@contextlib.contextmanager
def _run_dir_lock(run_dir: Path):
    """Create `run_dir` and hold an exclusive lock on RUN_DIR/.lock for the run.

    Two trainers on one run directory would overwrite each other's versions and checkpoints. The
    kernel drops the lock when its holder dies in any way (SIGKILL included), so no stale lock is
    ever left to clear by hand.

    Raises:
        RunDirError: `run_dir` is a file or lies under one, or another process holds the lock.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = hold_lock(run_dir / ".lock")
    except (FileExistsError, NotADirectoryError) as error:
        raise RunDirError(f"run directory {run_dir} cannot be created: {error.filename} is a file") from None
    except LockHeldError as holder:
        raise RunDirError(f"run directory {run_dir} is in use by another graft process ({holder}): "
                          "choose another --run-dir") from None
    with handle:
        yield
