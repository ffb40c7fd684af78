"""TRL's side of test_trl_update_parity, run in the benches' TRL virtualenv:
`python -m tests.rl.trl_update_worker SPEC.json OUT.json` (graft.bench.trl.env.run_trl).

TRL's real GRPOTrainer steps, one per fixed rollout batch (generation replaced by the batch, as in
`graft bench update`), from graft's LoRA initialisation (`attach_lora`, PEFT's, seeded); writes the
trained LoRA weights as safetensors, named as graft names them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(spec: dict, out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from graft.bench.memory_shape import trl_generation_batch
    from graft.bench.trl.worker import trl_arguments
    from graft.lora.attach import attach_lora, lora_parameters

    base = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
    model = attach_lora(base, rank=spec["rank"], alpha=spec["alpha"], seed=spec["seed"])
    batches = [trl_generation_batch([tuple(row) for row in rows], torch.tensor(rewards_PG))
               for rows, rewards_PG in spec["batches"]]
    rows = len(spec["batches"][0][0])

    class FixedBatches(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            return dict(batches[self.state.global_step])

    settings = {"prompts": rows // spec["samples"], "samples": spec["samples"], "mini_batches": 1, "seed": spec["seed"],
                "max_new_tokens": max(len(c) for b in spec["batches"] for _, c in b[0]), "lr": spec["lr"],
                "steps": len(batches)}
    args = trl_arguments(settings, str(out_dir / "trl-output"))
    args.update(per_device_train_batch_size=rows, gradient_accumulation_steps=1, steps_per_generation=1)
    trainer = FixedBatches(model=model, processing_class=AutoTokenizer.from_pretrained(spec["base"]),
                           reward_funcs=lambda prompts, completions, **_: [0.0] * len(prompts),
                           train_dataset=Dataset.from_list([{"prompt": "x"}] * rows * len(batches)),
                           args=GRPOConfig(**args))
    trainer.train()
    weights = out_dir / "trl-lora.safetensors"
    save_file({name: p.detach().contiguous() for name, p in lora_parameters(trainer.model).items()}, str(weights))
    return {"weights": str(weights), "optimizer_steps": trainer.state.global_step}


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    result = run(json.loads(Path(spec_path).read_text()), Path(out_path).parent)
    Path(out_path).write_text(json.dumps(result))
