"""Held-out accuracy: greedy answers from an engine, scored by data.eval_reward, else the run's
reward (data.reward or the weighted sum of data.rewards); exact numeric match when no scorer is given.

The mean score is reported as "accuracy": for a 0/1 reward such as exact_numeric or math it is the
fraction answered right. Used by the trainer (before, during and after a run) and by
`graft eval CONFIG [--adapter DIR]`.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from graft.config import GraftConfig
from graft.lora.adapter_io import read_adapter_config
from graft.models.loading import load_tokenizer
from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    UnknownAdapterError,
)
from graft.rollout.episodes import EpisodeLimits, evaluate_episodes
from graft.rollout.factory import open_engine
from graft.sync.guard import check_finite_adapter_dir
from graft.tasks.envs import resolve_env
from graft.tasks.examples import Example
from graft.tasks.prompts import CHAT, PromptFormat, run_prompt_format
from graft.tasks.registry import load_task_data
from graft.tasks.reward_loading import load_eval_scorer
from graft.tasks.rewards import exact_numeric
from graft.tasks.scoring import RewardTerm, Scorer

EVAL_ADAPTER_SUFFIX = "eval"


async def evaluate(engine: RolloutEngine, adapter: str | None, examples: list[Example], tokenizer,
                   max_new_tokens: int, scorer: Scorer | None = None, prompts: PromptFormat = CHAT) -> float:
    """Mean score of the greedy completions (served as `adapter`) of `examples`, rendered and ended
    as `prompts` says: with the default scorer (exact_numeric), the fraction that ends with the right
    number."""
    scorer = scorer or Scorer([RewardTerm("exact_numeric", exact_numeric)])
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, stop=prompts.stop)
    requests = [GenerateRequest(tuple(prompts.ids(tokenizer, ex)), params) for ex in examples]
    completions_P = await engine.generate(requests, adapter=adapter)
    texts = [prompts.completion_text(tokenizer, c[0].token_ids) for c in completions_P]
    scores = await scorer(texts, examples)
    return sum(scores.rewards) / len(examples)


async def run_eval(config: GraftConfig, run_dir: str | Path, adapter_dir: str | Path | None = None) -> dict:
    """`graft eval`: held-out accuracy of the base model, or of base + the PEFT adapter at `adapter_dir`.

    Raises:
        AdapterError: `adapter_dir` is not a readable PEFT LoRA adapter.
    """
    if adapter_dir is not None:
        read_adapter_config(adapter_dir)  # a clear error before any server starts
        # NaN/inf weights, or finite ones whose forward overflows, never reach a (possibly shared) server.
        check_finite_adapter_dir(config.require_model_path("evaluate an adapter"), config.model.dtype, adapter_dir)
    env = resolve_env(config.data.env) if config.data.env is not None else None
    scorer = None if env else load_eval_scorer(config.data)
    _, eval_set = load_task_data(config.data)
    examples = eval_set[: config.train.eval_examples]
    tokenizer = load_tokenizer(config.model.path)
    prompts = run_prompt_format(config, tokenizer, examples)
    start = time.perf_counter()
    path = str(Path(adapter_dir).resolve()) if adapter_dir is not None else None
    name = eval_adapter_name(config.lora.name, path) if path is not None else None
    async with open_engine(config, run_dir, syncs=False) as engine:  # eval reloads no weights
        if name is not None:
            await _unload_earlier_evaluations(engine, config.lora.name, name)
        async with loaded_adapter(engine, name, path) as adapter:
            if env is not None:  # multi-turn: the mean reward of greedy episodes
                accuracy = await evaluate_episodes(engine, adapter, env, examples, tokenizer,
                                                   config.rollout.max_new_tokens, EpisodeLimits.of(config))
            else:
                accuracy = await evaluate(engine, adapter, examples, tokenizer, config.rollout.max_new_tokens,
                                          scorer, prompts)
    return {"accuracy": accuracy, "examples": len(examples), "adapter": str(adapter_dir) if adapter_dir else None,
            "model": config.model.path, "seconds": time.perf_counter() - start}


def eval_adapter_name(lora_name: str, adapter_dir: str | Path) -> str:
    """`<lora.name>-eval-<digest of the adapter's files>`: an adapter evaluated is named by its weights.

    Why not one name for every evaluation: a vLLM keys the prefix-cache blocks an adapter computed by
    its name (0.20) or its name and path (0.32) and keeps them after an unload, so on a server graft
    did not start the next adapter evaluated under that name (or the same directory trained further)
    was served the earlier one's KV for the held-out prompts they share. (The servers graft starts key
    blocks by the load: `graft.rollout.vllm.server.versions`.)
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(adapter_dir).iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return f"{lora_name}-{EVAL_ADAPTER_SUFFIX}-{digest.hexdigest()[:16]}"


async def _unload_earlier_evaluations(engine: RolloutEngine, lora_name: str, name: str) -> None:
    """Unload the adapters a killed `graft eval` with this `lora.name` left loaded (but `name`, which
    `loaded_adapter` loads again): each would hold one of the server's adapter slots."""
    prefix = f"{lora_name}-{EVAL_ADAPTER_SUFFIX}-"
    for leftover in [n for n in await engine.list_adapters() if n.startswith(prefix) and n != name]:
        with contextlib.suppress(UnknownAdapterError):  # gone meanwhile
            await engine.unload_adapter(leftover)


@contextlib.asynccontextmanager
async def loaded_adapter(engine: RolloutEngine, name: str, path: str | None) -> AsyncIterator[str | None]:
    """The adapter at `path` loaded as `name` for the block, unloaded after; the base model (None)
    when `path` is None. A `name` left loaded by a killed `graft eval` is unloaded first."""
    if path is None:
        yield None
        return
    try:
        await engine.load_adapter(name, path)
    except AdapterAlreadyLoadedError:
        await engine.unload_adapter(name)
        await engine.load_adapter(name, path)
    try:
        yield name
    finally:
        await engine.unload_adapter(name)
