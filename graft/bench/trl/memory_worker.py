"""The TRL side of `graft bench memory`: one `GRPOTrainer` + PEFT optimizer step on graft's batch.

Runs as `python -m graft.bench.trl.memory_worker SPEC.json OUT.json` in the TRL virtualenv
(`graft.bench.trl.env.run_trl`), one fresh process per measurement, so its `ru_maxrss` is this
update's alone. From graft it imports `graft.bench.memory_shape` (torch and transformers) and the
e2e worker's micro-batch rule and entry (`graft.bench.trl.worker`, pure Python): the same seed gives the same
weights, token ids and ragged lengths as graft's measurement.

Generation is replaced, not timed: `_generate_and_score_completions` returns the fixed batch in
the form TRL's own returns, and everything after it is TRL's real training path (`train()` for one
optimizer step: shuffle, split into micro-batches, `training_step` with its fused LM head and
gradient accumulation, clipping, AdamW). The seconds are that step's, from `on_step_begin` to
`on_step_end`; the peak is reported next to the RSS after building the model and its LoRA.
"""

from __future__ import annotations

import resource
import time

from graft.bench.memory_shape import GROUP, PAD_ID, build_model, memory_batch, trl_generation_batch, unpadded_rows
from graft.bench.trl.worker import rows_within_budget, worker_main

CONFIGS = ("trl-defaults", "graft-settings")


def micro_batch_rows(config: str, sequences: int, padded_length: int) -> int:
    """TRL's `per_device_train_batch_size` for `config`; TRL needs it to divide the generation batch.

    trl-defaults: TRL's default, 8. graft-settings: the most rows within graft's token budget at
    TRL's padded length (TRL pads every completion to the generation batch's longest)."""
    if config == "trl-defaults":
        return min(8, sequences)
    return rows_within_budget(sequences, padded_length)


def trl_memory_arguments(config: str, sequences: int, padded_length: int, output_dir: str) -> dict:
    """GRPOConfig keyword arguments: one optimizer step over all `sequences` (gradient accumulation
    over micro-batches, steps_per_generation equal to it, so no old-log-prob pass), fp32 on the CPU.

    trl-defaults keeps TRL's gradient checkpointing (on), optimizer and learning rate; fp32 instead
    of TRL's default bf16, because graft's side is fp32. graft-settings: gradient checkpointing as
    graft's train.activation_checkpointing default (on), graft's token budget per micro-batch,
    torch AdamW, lr 1e-4, clip 0.2, grad norm 1.0 (as `worker.trl_arguments`)."""
    rows = micro_batch_rows(config, sequences, padded_length)
    args = dict(output_dir=output_dir, use_cpu=True, use_vllm=False, bf16=False, fp16=False, seed=0,
                per_device_train_batch_size=rows, gradient_accumulation_steps=sequences // rows,
                num_generations=GROUP, max_completion_length=padded_length, max_steps=1, logging_steps=10**9,
                save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    if config == "graft-settings":
        args.update(gradient_checkpointing=True, optim="adamw_torch", learning_rate=1e-4, weight_decay=0.01,
                    lr_scheduler_type="constant", max_grad_norm=1.0, epsilon=0.2, beta=0.0, loss_type="dapo",
                    scale_rewards="group")
    return args


def placeholder_tokenizer():
    """A three-token tokenizer: TRL wants a processing class for its pad id; nothing is tokenized."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def run(spec: dict) -> dict:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows, rewards_PG = memory_batch(spec["sequences"], spec["dims"]["vocab"], spec["prompt_tokens"],
                                    tuple(spec["completion_tokens"]))
    generation_batch = trl_generation_batch(rows, rewards_PG)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(build_model(spec["dims"], spec["layers"]), lora)
    model_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    padded_length = generation_batch["prompt_ids"].shape[1] + generation_batch["completion_ids"].shape[1]
    args = trl_memory_arguments(spec["config"], spec["sequences"], padded_length, "trl-output")
    seen: list[tuple[list[int], list[int]]] = []
    clock = {}

    class FixedBatchTrainer(GRPOTrainer):
        """GRPOTrainer whose generation step hands over the fixed batch; with `echo_batch` it notes
        the rows of every micro-batch its loss sees."""

        def _generate_and_score_completions(self, inputs):
            return dict(generation_batch)

        def _compute_loss(self, model, inputs):
            if spec.get("echo_batch"):
                seen.extend(unpadded_rows(inputs))
            return super()._compute_loss(model, inputs)

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock["start"], clock["cpu_start"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            clock["seconds"] = time.perf_counter() - clock["start"]
            clock["cpu_seconds"] = time.process_time() - clock["cpu_start"]

    def no_reward(prompts, completions, **_):
        return [0.0] * len(prompts)

    trainer = FixedBatchTrainer(model=model, processing_class=placeholder_tokenizer(), reward_funcs=no_reward,
                                train_dataset=Dataset.from_list([{"prompt": "x"}] * spec["sequences"]),
                                args=GRPOConfig(**args), callbacks=[StepClock()])
    setup_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.train()
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"config": spec["config"], "model_bytes": model_bytes, "setup_bytes": setup_bytes, "peak_bytes": peak_bytes,
           "seconds": clock["seconds"], "cpu_seconds": clock["cpu_seconds"],
           "tokens": sum(len(p) + len(c) for p, c in rows),
           "gradient_checkpointing": trainer.args.gradient_checkpointing,
           "per_device_train_batch_size": args["per_device_train_batch_size"],
           "gradient_accumulation_steps": args["gradient_accumulation_steps"], "padded_length": padded_length,
           "optim": str(trainer.args.optim.value if hasattr(trainer.args.optim, "value") else trainer.args.optim),
           "optimizer_steps": trainer.state.global_step, "trl_version": __import__("trl").__version__}
    if spec.get("echo_batch"):
        out["batch"] = seen
    return out


if __name__ == "__main__":
    worker_main(run)
