"""`graft bench e2e` / `graft bench learning`: both sides get the same settings, the TRL worker
scores with graft's reward on graft's prompts, and a short real run of each side (graft on the
session's vLLM server, TRL in its own virtualenv) gives sane per-step rows and loadable adapters."""

import asyncio
import json

import httpx
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft.bench import e2e, learning
from graft.bench.e2e import (
    Workload,
    _reload_base,
    graft_overrides,
    graft_steps,
    one_call_seconds,
    reserved_cores_per_side,
    summarise,
    trl_spec,
    trl_steps,
)
from graft.bench.learning import (
    graft_config,
    graft_curve,
    per_batch_gaps,
    plot_learning,
    race,
    score_adapters,
    time_to_reach,
)
from graft.bench.learning import trl_spec as learning_trl_spec
from graft.bench.common import prepare_adapter_and_merged
from graft.bench.trl.env import run_trl, trl_python
from graft.bench.trl.worker import prompt_rows, reward_function, trl_arguments
from graft.cli import main
from graft.config import load_config
from graft.models.cache import default_cache_dir
from graft.rollout.vllm.client import VllmClient
from graft.tasks import Example, render_prompt_ids
from graft.tasks.registry import load_task_data
from graft.tasks.rewards import exact_numeric_and_format
from graft.train.metrics import read_jsonl
from graft.train.step_plan import step_examples

WORKLOAD = Workload("test", prompts=2, samples=4, max_new_tokens=4)


def test_trl_arguments_match_graft_settings(base_dir):
    config = load_config(None, graft_overrides(base_dir, "http://127.0.0.1:1", WORKLOAD, 5, 3, "x"))
    spec = trl_spec(base_dir, WORKLOAD, 5, 3)
    args = trl_arguments({**spec, "mini_batches": 2}, "out")
    # One rollout batch = prompts x samples completions, in mini_batches optimizer steps.
    assert args["per_device_train_batch_size"] * args["steps_per_generation"] == 2 * 4
    assert args["steps_per_generation"] == 2 and args["num_generations"] == config.rollout.n_samples
    assert args["max_completion_length"] == config.rollout.max_new_tokens
    assert args["learning_rate"] == config.train.lr and args["max_grad_norm"] == config.train.grad_clip
    assert args["epsilon"] == config.train.clip_eps and args["beta"] == config.train.kl_coef == 0
    assert args["loss_type"] == "dapo" and config.train.loss_agg == "token-mean"
    assert args["scale_rewards"] == "group" and config.train.normalize_adv_std
    assert not args["bf16"] and config.model.dtype == "float32" and not args["gradient_checkpointing"]
    assert args["lr_scheduler_type"] == config.train.lr_schedule == "constant" and config.train.warmup_steps == 0
    assert args["weight_decay"] == config.train.weight_decay
    assert (spec["rank"], spec["alpha"], spec["targets"]) == (config.lora.rank, config.lora.alpha,
                                                               config.lora.target_modules)
    assert config.rollout.max_staleness == 0 and config.train.mini_batches == 1


def test_trl_micro_batches_keep_to_graft_token_budget_with_the_same_optimizer_steps(base_dir):
    spec = {**trl_spec(base_dir, Workload("big", prompts=16, samples=8, max_new_tokens=32), 5, 0), "mini_batches": 2}
    whole = trl_arguments(spec, "out", padded_length=100)  # 64 rows x 100 tokens fit 8192
    assert (whole["per_device_train_batch_size"], whole["gradient_accumulation_steps"]) == (64, 1)
    # 128 rows of 78 tokens (SmolLM2's prompts + 32 new) exceed graft's 8192 tokens: 2 x 64 accumulated.
    split = trl_arguments({**spec, "mini_batches": 1}, "out", padded_length=78)
    assert (split["per_device_train_batch_size"], split["gradient_accumulation_steps"]) == (64, 2)
    # SmolLM2's 30 layers x 576: 64 rows of 78 tokens (86M activations) were killed for memory, 32 fit.
    smol = trl_arguments({**spec, "mini_batches": 1}, "out", padded_length=78, layer_width=30 * 576)
    assert (smol["per_device_train_batch_size"], smol["gradient_accumulation_steps"]) == (32, 4)
    long = trl_arguments(spec, "out", padded_length=300)
    assert long["per_device_train_batch_size"] * 300 <= 8192 and 64 % long["per_device_train_batch_size"] == 0
    for args in (whole, split, smol, long):  # one generation batch = the rollout batch, mini_batches optimizer steps
        rows = args["per_device_train_batch_size"] * args["steps_per_generation"]
        assert rows == 128 and args["steps_per_generation"] // args["gradient_accumulation_steps"] in (1, 2)
    assert long["steps_per_generation"] // long["gradient_accumulation_steps"] == 2


def test_each_graft_side_gets_the_server_setting_graft_train_would_launch(tmp_path, base_dir):
    from graft.models.tiny import build_tiny_model

    # The quickstart-sized base keeps vLLM's default on both sides; from 10M parameters the
    # on-policy side generates on every core while the overlapped side keeps vLLM's default.
    assert reserved_cores_per_side(base_dir) == {"graft": None, "graft-async": None, "graft-merged": None}
    big = build_tiny_model(tmp_path / "big", arch="qwen2", hidden=512, layers=8, seed=0)
    assert reserved_cores_per_side(big) == {"graft": 0, "graft-async": None, "graft-merged": 0}


def test_trl_prompts_tokenize_like_graft_and_score_with_graft_reward(base_dir):
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    examples = [Example("What is 2 + 3? Answer with the number only.", "5"), Example("What is 1 + 1?", "2")]
    rows = prompt_rows(examples)
    for row, example in zip(rows, examples):
        # What TRL does with a conversational prompt (GRPOTrainer._tokenize_prompts).
        ids = tokenizer.apply_chat_template(conversation=[row["prompt"]], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"][0]
        assert list(ids) == render_prompt_ids(tokenizer, example)
    reward = reward_function(examples, "exact_numeric+format")
    completions = [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "it is 3"}],
                   [{"role": "assistant", "content": "2"}]]
    scores = reward([r["prompt"] for r in rows], completions, example_index=[0, 0, 1])
    assert scores == [exact_numeric_and_format("5", examples[0]), exact_numeric_and_format("it is 3", examples[0]),
                      exact_numeric_and_format("2", examples[1])] == [1.0, 0.0, 1.0]


def test_summarise_takes_medians_over_repetitions_the_ratios_and_the_floor():
    def step(seconds):
        return {"seconds": seconds, "rollout_seconds": seconds / 2, "train_seconds": seconds / 4,
                "sync_seconds": 0.1, "verify_seconds": 0.05, "completion_tokens_mean": 4.0}
    row = summarise(WORKLOAD, {"graft": [[step(1.0), step(2.0)], [step(3.0)]],
                               "graft-async": [[step(1.0)], [step(1.0)]],
                               "graft-merged": [[step(0.8)], [step(0.8)]],
                               "trl": [[step(4.0), step(9.0)], [step(5.0)]]},
                    one_call={"adapter": [0.2, 0.5, 0.3], "base": [0.1, 0.2]})
    assert row["graft_seconds_per_step"] == 2.0 and row["trl_seconds_per_step"] == 5.0 and row["ratio"] == 2.5
    assert row["graft-async_ratio"] == 5.0
    assert row["graft"]["rollout_seconds"] == 1.0 and row["graft"]["repetition_medians"] == [1.5, 3.0]
    assert (row["name"], row["prompts"], row["samples"], row["max_new_tokens"]) == ("test", 2, 4, 4)
    # floor = the median one-call generation + graft's median update
    assert row["one_call_seconds"] == 0.3 and row["floor_seconds"] == pytest.approx(0.3 + 0.5)
    assert row["graft_over_floor"] == pytest.approx(2.0 / 0.8)
    assert row["graft-async_over_floor"] == pytest.approx(1 / 0.8)
    # the merged side samples through the base weights: its floor is that call's + the update
    assert row["floor_base_seconds"] == pytest.approx(0.15 + 0.5)
    assert row["graft-merged_over_floor"] == pytest.approx(0.8 / 0.65) and row["graft-merged_ratio"] == 5.0 / 0.8
    assert row["graft-merged_rollout_over_one_call"] == pytest.approx(0.4 / 0.15)
    assert row["graft_rollout_over_one_call"] == pytest.approx(1.0 / 0.3)


def test_learning_curve_counts_step_seconds_only(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_seconds": 2.0}) + "\n"
                                                    for s in (1, 2, 3, 4)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": a}) + "\n"
                                                 for s, a in ((0, 0.4), (2, 0.5), (4, 0.7))))
    points = graft_curve(tmp_path)
    assert [(p["seconds"], p["accuracy"]) for p in points] == [(0.0, 0.4), (4.0, 0.5), (8.0, 0.7)]
    assert time_to_reach(points, 0.5) == 4.0 and time_to_reach(points, 0.9) is None
    trl = [{"seconds": 0.0, "accuracy": 0.4, "in_budget": True}, {"seconds": 8.0, "accuracy": 0.45, "in_budget": True},
           {"seconds": 12.0, "accuracy": 0.8, "in_budget": False}]  # past graft's 8 s: not in the race
    assert race(trl) == trl[:2] and race(points) == points
    result = {"model": "tiny", "reward": "r", "trl_version": "1", "graft": {"points": points}, "trl": {"points": trl}}
    png = plot_learning(result, tmp_path / "learning.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_batch_gaps_pair_the_evaluations_of_equal_rollout_batch_counts():
    """TRL's points count optimizer steps (mini_batches per rollout batch); graft's count batches."""
    graft = [{"step": s, "accuracy": a} for s, a in ((0, 0.5), (25, 0.7), (50, 0.8), (75, 0.9))]
    trl = [{"step": s, "accuracy": a} for s, a in ((0, 0.5), (100, 0.75), (200, 0.7))]
    gaps = per_batch_gaps({"graft": {"points": graft}, "trl": {"points": trl, "mini_batches": 4}})
    assert [g["batches"] for g in gaps] == [25, 50]
    assert [g["gap"] for g in gaps] == pytest.approx([-0.05, 0.1])


def test_bench_learning_command_runs_the_seed_it_is_given(monkeypatch, tmp_path):
    """Seeds 1 and 2 of the learning target are reproducible from the CLI, not only from Python."""
    calls = []
    monkeypatch.setattr(learning, "run_learning_bench",
                        lambda **kwargs: calls.append(kwargs) or {"seed": kwargs["seed"]})
    monkeypatch.setattr(learning, "print_learning_report", lambda result: None)
    out = tmp_path / "learning.json"
    assert main(["bench", "learning", "--seed", "2", "--plot-dir", str(tmp_path), "--json", str(out)]) == 0
    assert calls == [{"steps": None, "seed": 2, "out_dir": tmp_path, "model": "tiny"}]
    assert json.loads(out.read_text()) == {"seed": 2}
    assert main(["bench", "learning", "--model", "smollm2", "--steps", "3", "--plot-dir", str(tmp_path)]) == 0
    assert calls[1] == {"steps": 3, "seed": 0, "out_dir": tmp_path, "model": "smollm2"}


@pytest.mark.vllm
@pytest.mark.trl
def test_both_sides_run_a_real_short_step_loop(vllm_server, base_dir, tmp_path):
    graft_rows = graft_steps(base_dir, vllm_server.url, WORKLOAD, 2, 0, tmp_path / "graft")
    graft_steps(base_dir, vllm_server.url, WORKLOAD, 3, 0, tmp_path / "graft-async", max_staleness=1)
    try:
        graft_steps(base_dir, vllm_server.url, WORKLOAD, 2, 0, tmp_path / "graft-merged", sync_mode="merged")
    finally:
        asyncio.run(_reload_base(vllm_server.url, base_dir))  # as the bench does after a merged run
    assert {r["sync_mode"] for r in read_jsonl(tmp_path / "graft-merged" / "metrics.jsonl")} == {"merged"}
    python = trl_python(default_cache_dir())
    trl_rows = trl_steps(python, base_dir, WORKLOAD, 2, 0, tmp_path / "trl")
    assert [r["staleness_max"] for r in read_jsonl(tmp_path / "graft-async" / "metrics.jsonl")] == [0, 1, 1]
    for rows in (graft_rows, trl_rows):
        assert len(rows) == 2
        assert all(r["seconds"] > 0 and r["rollout_seconds"] > 0 and 0 < r["completion_tokens_mean"] <= 4
                   for r in rows)
    assert all(r["sync_seconds"] > 0 for r in graft_rows)  # graft publishes and loads every version
    assert all(r["sync_seconds"] == 0 for r in trl_rows)  # TRL generates with the training weights


@pytest.mark.vllm
def test_one_call_floor_generates_the_workload_through_the_adapter(vllm_server, base_dir, tmp_path):
    adapter, _ = prepare_adapter_and_merged(base_dir, tmp_path, 8, torch.float32)
    asyncio.run(_load(vllm_server.url, "floor-v1", adapter))
    try:
        seconds = one_call_seconds(vllm_server.url, base_dir, "floor-v1", WORKLOAD, calls=2)
    finally:
        asyncio.run(_unload(vllm_server.url, "floor-v1"))
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    with pytest.raises(httpx.HTTPStatusError):  # through the adapter: an unloaded one is refused
        one_call_seconds(vllm_server.url, base_dir, "floor-v1", WORKLOAD, calls=1)


async def _load(url: str, name: str, path) -> None:
    async with VllmClient(url) as client:
        await client.load_adapter(name, str(path))


async def _unload(url: str, name: str) -> None:
    async with VllmClient(url) as client:
        await client.unload_adapter(name)


@pytest.mark.vllm
@pytest.mark.trl
def test_trl_adapters_saved_on_the_clock_load_in_peft_and_score_on_vllm(vllm_server, base_dir, tmp_path):
    config = graft_config(base_dir, vllm_server.url, steps=2, eval_every=1, seed=0,
                          extra=["train.batch_prompts=2", "rollout.n_samples=4", "train.eval_examples=8"])
    spec = {**learning_trl_spec(config, budget_s=1e9, eval_every=1, save_dir=tmp_path / "adapters", batches=2),
            "steps": 4, "logging_steps": 4}
    result = run_trl(trl_python(default_cache_dir()), spec, tmp_path / "trl")
    assert [s["step"] for s in result["steps"]] == [1, 2, 3, 4]
    # TRL's rollout batch holds graft's first batch's prompts (graft's order, not TRL's shuffle).
    train_set, _ = load_task_data(config.data)
    graft_first = step_examples(list(range(len(train_set))), 1, 2, config.train.seed)
    assert spec["prompt_order"][:2] == graft_first and len(spec["prompt_order"]) == 4
    assert all(s["prompt_indices"] == graft_first for s in result["steps"])
    # TRL's own statistics of the rollout batch, to set beside graft's metrics.jsonl; graft deals its
    # mini-batches at random as TRL shuffles its generation batch.
    (logged,) = [row for row in result["log_history"] if "reward" in row]
    assert logged["step"] == 4 and {"grad_norm", "entropy", "clip_ratio/region_mean"} <= logged.keys()
    assert config.train.shuffle_mini_batches
    # mini_batches 4 -> an adapter every 4 optimizer steps (one rollout batch), with its clock.
    assert [a["step"] for a in result["adapters"]] == [4]
    assert result["adapters"][0]["clock"] == pytest.approx(sum(s["seconds"] for s in result["steps"]))
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                           result["adapters"][0]["path"])
    lora_a = [p for name, p in model.named_parameters() if name.endswith("lora_A.default.weight")]
    assert len(lora_a) == 14 and all(p.shape[0] == 8 and p.abs().sum() > 0 for p in lora_a)  # 7 linears x 2 layers
    points = asyncio.run(score_adapters(config, tmp_path / "eval", result["adapters"]))
    assert len(points) == 1 and points[0]["step"] == 4 and 0 <= points[0]["accuracy"] <= 1
    assert asyncio.run(_served_adapters(vllm_server.url)) == []  # every scored adapter unloaded again


@pytest.mark.trl
def test_trl_saves_the_step_its_budget_runs_out_in_and_goes_on_to_grafts_batches(base_dir, tmp_path):
    """A slower TRL may get fewer optimizer steps in graft's seconds than one save interval: the step
    the budget runs out in is saved anyway (its final point in the race), and TRL goes on to graft's
    batch count, saving its last step, for the per-batch comparison."""
    config = graft_config(base_dir, "http://127.0.0.1:1", steps=2, eval_every=4, seed=0,
                          extra=["train.batch_prompts=2", "rollout.n_samples=4", "train.mini_batches=1"])
    spec = {**learning_trl_spec(config, budget_s=1e-6, eval_every=4, save_dir=tmp_path / "adapters", batches=2),
            "steps": 4}
    result = run_trl(trl_python(default_cache_dir()), spec, tmp_path / "trl")
    assert result["budget_step"] == 1  # the budget ran out in the first step
    assert [s["step"] for s in result["steps"]] == [1, 2] and spec["min_steps"] == 2
    assert [a["step"] for a in result["adapters"]] == [1, 2] and spec["save_every"] == 4


async def _served_adapters(url: str) -> list[str]:
    async with VllmClient(url) as client:
        return await client.list_adapters()


def test_e2e_model_points_from_the_command_line():
    import argparse

    from graft.bench.e2e import MODELS, bench_models

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    assert bench_models(parser.parse_args([])) == MODELS
    assert bench_models(parser.parse_args(["--hidden", "256", "--layers", "4"])) == ((256, 4),)
    assert bench_models(parser.parse_args(["--model", "smollm2"])) == ("smollm2",)
