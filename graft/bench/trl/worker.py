"""The TRL side of `graft bench e2e` / `graft bench learning`: TRL's GRPOTrainer with a PEFT LoRA.

Runs as `python -m graft.bench.trl.worker SPEC.json OUT.json` in the bench's own TRL virtualenv
(`graft.bench.trl.env`), never in graft's: TRL is not one of graft's dependencies. It imports only
`graft.tasks` from graft (pure Python), so both libraries train on the same prompts, chat template
and reward code.

The spec matches graft's settings one for one (see `trl_arguments`); it writes per-step timings
(step, generation + scoring = "rollout", the rest = "train"), when asked PEFT adapters saved
during training for the learning-curve bench (saving is outside the timed steps), and TRL's own
logged metrics (reward, grad norm, clip ratios) every `logging_steps` optimizer steps if the spec
sets it, to compare per-batch training statistics with graft's metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from graft.config import DataConfig
from graft.tasks import Example, get_reward, load_task_data
from graft.train.memory_budget import MIN_AUTO_TOKENS

# graft's train.max_tokens_per_micro_batch on the CPU at real shapes (auto's least): padded tokens per
# forward/backward.
GRAFT_TOKEN_BUDGET = MIN_AUTO_TOKENS
# TRL without gradient checkpointing keeps every layer's activations of a micro-batch: at most this many
# hidden values (rows x padded tokens x layers x hidden). Measured on this 23 GiB machine at SmolLM2:
# 86M (64 rows x 78 tokens) was killed for memory beside the e2e bench's two vLLM servers; 69M (64 x 62)
# ran beside the learning bench's one.
TRL_ACTIVATION_BUDGET = 72_000_000


def rows_within_budget(rows: int, padded_length: int, layer_width: int = 0,
                       token_budget: int | None = GRAFT_TOKEN_BUDGET) -> int:
    """The most rows dividing `rows` (TRL needs its micro-batch to divide the mini-batch) whose padded
    tokens fit `token_budget` (graft's; None: no limit) and, given `layer_width` (layers x hidden),
    whose activations fit `TRL_ACTIVATION_BUDGET`; 1 at least."""
    def fits(n: int) -> bool:
        tokens = n * padded_length
        return (token_budget is None or tokens <= token_budget) and tokens * layer_width <= TRL_ACTIVATION_BUDGET
    return max((n for n in range(1, rows + 1) if rows % n == 0 and fits(n)), default=1)


def prompt_rows(examples: list[Example]) -> list[dict]:
    """Dataset rows TRL applies the tokenizer's chat template to: one user turn, like graft's
    `render_prompt_ids`; `example_index` lets the reward find the answer."""
    return [{"prompt": [{"role": "user", "content": ex.prompt}], "example_index": i} for i, ex in enumerate(examples)]


def ordered_rows(rows: list[dict], order: list[int] | None) -> list[dict]:
    """`rows` in graft's prompt order (train-set indices, batch after batch) where the spec gives one,
    TRL's sampler then keeping it (`shuffle_dataset` off): both sides learn from the same prompts per
    batch. Without an order TRL shuffles the rows with its own seed."""
    return rows if order is None else [rows[i] for i in order]


def reward_function(examples: list[Example], reward_name: str):
    """A TRL reward function (prompts, completions, **dataset columns) -> list of floats that scores
    each completion with graft's reward of the same name."""
    reward = get_reward(reward_name)

    def graft_reward(prompts, completions, example_index, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(text, examples[i]) for text, i in zip(texts, example_index)]

    graft_reward.__name__ = reward_name
    return graft_reward


def trl_arguments(spec: dict, output_dir: str, padded_length: int = 0, layer_width: int = 0) -> dict:
    """GRPOConfig keyword arguments equal to graft's settings for the spec.

    One rollout batch is `prompts x samples` completions, split into `mini_batches` optimizer steps
    (graft's train.mini_batches == TRL's steps_per_generation; both deal the rows at random: TRL
    shuffles its generation batch, graft has train.shuffle_mini_batches), one pass (num_iterations
    1), PPO clip 0.2, token-mean loss over the whole batch ("dapo" == graft's token-mean),
    group-std-normalised advantages ("group" == graft's normalize_adv_std), no KL (beta 0), fp32,
    AdamW with weight decay 0.01 and a constant learning rate (graft's train.weight_decay and
    train.lr_schedule defaults).
    Gradient checkpointing is off: graft does not checkpoint, and on a model this small TRL's
    default (on) would only make TRL slower.
    A mini-batch runs in micro-batches within graft's token budget at TRL's `padded_length` (prompt +
    completion) and TRL's activation budget at the model's `layer_width` (layers x hidden), gradients
    accumulated: at SmolLM2 a 128-row micro-batch got TRL killed for memory; the toy points'
    mini-batches fit whole.
    """
    rows = spec["prompts"] * spec["samples"] // spec["mini_batches"]
    micro_rows = rows_within_budget(rows, padded_length, layer_width)
    return dict(
        output_dir=output_dir, use_cpu=True, use_vllm=False, bf16=False, fp16=False,
        gradient_checkpointing=False, seed=spec["seed"], data_seed=spec["seed"],
        per_device_train_batch_size=micro_rows, gradient_accumulation_steps=rows // micro_rows,
        steps_per_generation=spec["mini_batches"] * (rows // micro_rows), num_generations=spec["samples"],
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"], temperature=spec.get("temperature", 1.0), top_p=1.0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
        optim="adamw_torch", max_grad_norm=1.0, epsilon=0.2, beta=0.0, loss_type="dapo", scale_rewards="group",
        max_steps=spec["steps"], logging_steps=spec.get("logging_steps", 10**9), save_strategy="no",
        shuffle_dataset=spec.get("prompt_order") is None,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )


def padded_length(tokenizer, examples: list[Example], spec: dict) -> int:
    """The longest row TRL can pad to: the longest chat-templated prompt + max new tokens."""
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
             for row in prompt_rows(examples)]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) + spec["max_new_tokens"]


def timed_trainer_class():
    """TRL's GRPOTrainer, timing its generation + scoring (its "rollout"); the rest of a step is training."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        rollout_seconds = 0.0
        batch_stats: dict = {}

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            TimedGRPOTrainer.rollout_seconds += time.perf_counter() - start
            lengths = out["completion_mask"].sum(dim=1).float()
            TimedGRPOTrainer.batch_stats = {"completion_tokens_mean": lengths.mean().item(),
                                            "prompt_indices": list(dict.fromkeys(r["example_index"] for r in inputs))}
            return out

    return TimedGRPOTrainer


def step_clock(spec: dict, timed, steps: list[dict], adapters: list[dict], save_dir: Path | None):
    """A callback that appends each step's wall time to `steps` (its rollout part from `timed`, the
    trainer class), stops the run at the spec's time budget, but not before `min_steps` optimizer
    steps (the learning bench's per-batch comparison), and saves adapters into `save_dir` off the clock."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.started = 0.0
            self.clock = 0.0
            self.budget_step: int | None = None  # the step during which the time budget ran out

        def on_step_begin(self, args, state, control, **kwargs):
            timed.rollout_seconds = 0.0
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            seconds = time.perf_counter() - self.started
            self.clock += seconds
            rollout = timed.rollout_seconds
            steps.append({"step": state.global_step, "seconds": seconds, "rollout_seconds": rollout,
                          "train_seconds": seconds - rollout, "sync_seconds": 0.0, "verify_seconds": 0.0,
                          "clock": self.clock, **timed.batch_stats})
            out_of_time = bool(spec.get("time_budget_s")) and self.clock >= spec["time_budget_s"]
            budget_ends = out_of_time and self.budget_step is None
            if budget_ends:
                self.budget_step = state.global_step
            stop = out_of_time and state.global_step >= spec.get("min_steps", 0)
            # The step the budget runs out in is saved too: TRL's final point, also when the budget
            # bought fewer steps than `save_every`; and the last step.
            if save_dir is not None and (state.global_step % spec["save_every"] == 0 or budget_ends or stop):
                path = save_dir / f"step-{state.global_step}"
                model.save_pretrained(path)
                adapters.append({"step": state.global_step, "clock": self.clock, "path": str(path)})
            if stop:
                control.should_training_stop = True

    return StepClock()


def run(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    setup_start = time.perf_counter()
    train_set, _ = load_task_data(DataConfig(task=spec["task"], reward=spec["reward"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["base"])
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
    lora = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=spec["targets"],
                      task_type="CAUSAL_LM")
    steps: list[dict] = []
    adapters: list[dict] = []
    timed = timed_trainer_class()
    clock = step_clock(spec, timed, steps, adapters, Path(spec["save_dir"]) if spec.get("save_every") else None)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    trainer = timed(
        model=model, processing_class=tokenizer, peft_config=lora,
        reward_funcs=reward_function(train_set, spec["reward"]),
        train_dataset=Dataset.from_list(ordered_rows(prompt_rows(train_set), spec.get("prompt_order"))),
        args=GRPOConfig(**trl_arguments(spec, "trl-output", padded_length(tokenizer, train_set, spec),
                                        model.config.num_hidden_layers * model.config.hidden_size)),
        callbacks=[clock],
    )
    setup_seconds = time.perf_counter() - setup_start
    trainer.train()
    return {"budget_step": clock.budget_step, "setup_seconds": setup_seconds, "steps": steps, "adapters": adapters,
            "threads": torch.get_num_threads(), "trl_version": __import__("trl").__version__,
            "log_history": trainer.state.log_history}


def worker_main(measure) -> None:
    """A TRL worker's entry: `python -m MODULE SPEC.json OUT.json` writes `measure(spec)` as JSON."""
    spec_path, out_path = sys.argv[1:3]
    Path(out_path).write_text(json.dumps(measure(json.loads(Path(spec_path).read_text())), indent=1) + "\n")


if __name__ == "__main__":
    worker_main(run)
