"""The TRL side of `graft bench update`: `GRPOTrainer` + PEFT optimizer steps on graft's batch.

Runs as `python -m graft.bench.trl.update_worker SPEC.json OUT.json` (`graft.bench.trl.env.run_trl`),
in the TRL virtualenv or in graft's own python where TRL is installed there. As in `graft bench
memory`'s worker (whose TRL arguments and tokenizer it reuses), generation is replaced by the fixed
batch and everything after it is TRL's real training path; `train()` runs 1 + `repeats` optimizer
steps (one more, profiled, with `profile`), each over the whole batch. Each step is timed from
`on_step_begin` to `on_step_end`; the first is the warm-up.
"""

from __future__ import annotations

from pathlib import Path

from graft.bench.memory_shape import memory_batch, trl_generation_batch
from graft.bench.trl.memory_worker import placeholder_tokenizer, trl_memory_arguments
from graft.bench.trl.worker import rows_within_budget, worker_main
from graft.bench.update_measure import (
    UpdateClock,
    UpdateProfile,
    build_base,
    non_embedding_parameters,
)


def trl_update_arguments(spec: dict, padded_length: int, output_dir: str) -> dict:
    """GRPOConfig keyword arguments: `graft bench memory`'s (`spec["config"]`: one optimizer step per
    generation batch over all its rows), for 1 + repeats (+ 1 profiled) steps on `spec["device"]`, in
    TRL's bf16 mixed precision where the base is bf16 on a GPU. graft-settings after a graft side
    (`spec["graft_sizes"]`): the micro-batch and checkpointing that graft's update chose in this run
    (on a GPU its memory-sized micro-batches, often with no layer checkpointed), not the CPU's."""
    args = trl_memory_arguments(spec["config"], spec["sequences"], padded_length, output_dir)
    sizes = spec.get("graft_sizes")
    if spec["config"] == "graft-settings" and sizes:
        rows = rows_within_budget(spec["sequences"], padded_length, token_budget=sizes["micro_batch_tokens"])
        args.update(per_device_train_batch_size=rows, gradient_accumulation_steps=spec["sequences"] // rows,
                    gradient_checkpointing=sizes["checkpointed_layers"] > 0)
    cuda = spec["device"].startswith("cuda")
    args.update(max_steps=1 + spec["repeats"] + bool(spec.get("profile")), use_cpu=not cuda,
                bf16=cuda and spec["dtype"] == "bfloat16")
    return args


def run(spec: dict) -> dict:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows, rewards_PG = memory_batch(spec["sequences"], spec["dims"]["vocab"], spec["prompt_tokens"],
                                    (spec["completion_tokens"],))
    generation_batch = trl_generation_batch(rows, rewards_PG)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(build_base(spec), lora).to(spec["device"])
    clock = UpdateClock(spec["device"])
    model_bytes = clock.memory_bytes()
    padded_length = generation_batch["prompt_ids"].shape[1] + generation_batch["completion_ids"].shape[1]
    args = trl_update_arguments(spec, padded_length, "trl-output")
    profiled_step = 1 + spec["repeats"] if spec.get("profile") else None
    profiling: list[UpdateProfile] = []

    class FixedBatchTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            return dict(generation_batch)

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == profiled_step:
                profiling.append(UpdateProfile(spec["device"], Path(spec["profile"]) / "trl.txt").__enter__())
            else:
                clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            if profiling:
                profiling.pop().__exit__(None, None, None)
            else:
                clock.stop()

    def no_reward(prompts, completions, **_):
        return [0.0] * len(prompts)

    trainer = FixedBatchTrainer(model=model, processing_class=placeholder_tokenizer(), reward_funcs=no_reward,
                                train_dataset=Dataset.from_list([{"prompt": "x"}] * spec["sequences"]),
                                args=GRPOConfig(**args), callbacks=[StepClock()])
    trainer.train()
    return {**clock.result(model_bytes), "optimizer_steps": trainer.state.global_step,
            "non_embedding_parameters": non_embedding_parameters(model),
            "gradient_checkpointing": trainer.args.gradient_checkpointing, "bf16_autocast": trainer.args.bf16,
            "micro_batch_rows": args["per_device_train_batch_size"], "trl_version": __import__("trl").__version__}


if __name__ == "__main__":
    worker_main(run)
