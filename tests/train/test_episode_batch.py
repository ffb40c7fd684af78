"""Batches of multi-turn episodes: grouped by prompt, one policy version per episode, masks on the
model's tokens, seeds that no other step or episode shares; the engine's log-probs line up with the
trainer's on the model's tokens; the masks reach every rank; a run with a user environment trains."""

import asyncio
import json
import textwrap

import torch
import torch.distributed as dist

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.models.loading import load_tokenizer
from graft.parallel.dist import Dist
from graft.rollout.episodes import EpisodeLimits
from graft.rollout.reference import ReferenceEngine
from graft.sync.inflight import InFlightVersions
from graft.tasks.envs import ENVS
from graft.tasks.examples import Example
from graft.train.batch_broadcast import broadcast_batch
from graft.train.episode_batch import build_episode_batch
from graft.train.step_plan import episode_sampling_params
from graft.train.trainer import train
from graft.train.update import policy_update
from tests.helpers import trained_like_peft_model
from tests.spawn import spawn_ranks
from tests.train.test_loss_mask import _episodes


def _guessing_batch(base_dir, seed=3):
    config = load_config(None, ["rollout.n_samples=3", "rollout.max_new_tokens=4", "data.max_turns=3"])
    params = episode_sampling_params(config, step=1)
    examples = [Example("Guess my number from 1 to 16.", str(s)) for s in (3, 9)]
    inflight = InFlightVersions()
    batch = asyncio.run(build_episode_batch(
        ReferenceEngine(base_dir), adapter=None, version=5, inflight=inflight, examples=examples,
        tokenizer=load_tokenizer(base_dir), params=params, env_factory=ENVS["guessing"],
        limits=EpisodeLimits(max_turns=3)))
    assert inflight.busy() == set()  # every episode's lease was given back
    return batch


def test_an_episode_batch_is_grouped_by_prompt_and_masks_the_models_tokens(base_dir):
    batch = _guessing_batch(base_dir)
    assert batch.rewards_PG.shape == (2, 3) and batch.version == 5 and len(batch.sequences) == 6
    for (prompt, completion), mask, logprobs in zip(batch.sequences, batch.loss_masks, batch.engine_logprobs):
        assert len(mask) == len(completion) == len(logprobs) and mask[0]  # the model speaks first
        assert all(lp < 0 for lp, m in zip(logprobs, mask) if m) and all(lp == 0 for lp, m in zip(logprobs, mask)
                                                                          if not m)
    assert 1 <= batch.reward_metrics["episode_turns_mean"] <= 3
    assert batch.reward_metrics["episode_model_tokens_mean"] == sum(map(sum, batch.loss_masks)) / 6


def test_the_engines_logprobs_line_up_with_the_trainers_on_the_models_tokens(base_dir):
    batch = _guessing_batch(base_dir)
    config = load_config(None, ["train.tis_cap=2.0"])
    model = trained_like_peft_model(base_dir, seed=0)
    with torch.no_grad():  # B = 0: the base policy, which the engine sampled from (adapter None)
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.zero_()
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=0.0)
    metrics = policy_update(model, optimizer, batch, config.train, pad_id=0)
    assert metrics["logprob_abs_diff_max"] <= 1e-4
    assert metrics["mismatch_kl"] <= 1e-6 and abs(metrics["tis_weight_mean"] - 1) <= 1e-4


def _broadcast_main(rank: int, init_file, out_dir) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sent = _episodes(2, 3, seed=5)
        got = broadcast_batch(sent if rank == 0 else None, Dist(rank, 2))
        if rank == 1:
            (out_dir / "got.json").write_text(json.dumps({
                "same": got.sequences == sent.sequences and got.loss_masks == sent.loss_masks
                and got.engine_logprobs == sent.engine_logprobs and got.truncated == sent.truncated,
                "mask_truncated": got.mask_truncated}))
    finally:
        dist.destroy_process_group()


def test_the_loss_masks_reach_every_rank(tmp_path):
    spawn_ranks(_broadcast_main, (tmp_path / "rendezvous", tmp_path), 2)
    assert json.loads((tmp_path / "got.json").read_text()) == {"same": True, "mask_truncated": False}


USER_ENV = textwrap.dedent('''
    class Lengths:
        """Rewards short turns; done after two turns."""
        def reset(self, example):
            self.turns = 0
            return [{"role": "user", "content": example.prompt}]

        def step(self, model_text):
            self.turns += 1
            return [{"role": "user", "content": "More."}], 1.0 / (1 + len(model_text)), self.turns == 2
''')


def test_a_run_with_a_user_environment_trains_on_the_reference_engine(base_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lengths_env.py").write_text(USER_ENV)
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", "train.steps=2",
                                "train.batch_prompts=2", "rollout.n_samples=3", "rollout.max_new_tokens=4",
                                "lora.rank=4", "train.eval_examples=2", "train.kl_coef=0.01",
                                "data.env=lengths_env.py:Lengths", "data.max_turns=3"])
    result = asyncio.run(train(config, tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and 0 <= result["accuracy_after"] <= 1
    for row in rows:
        assert row["episode_turns_mean"] == 2 and row["truncated_fraction"] == 0
        assert row["logprob_abs_diff_max"] < 1e-4 and row["grad_norm"] > 0 and 0 < row["reward_mean"] <= 2
