"""The model and the batch of `graft bench memory`, built the same way by both sides.

Imported by graft's measurement process and by `graft.bench.trl.memory_worker` in the TRL
virtualenv, so it needs nothing but torch and transformers: the same seed gives both sides the same
weights, the same token ids and the same ragged completion lengths.
"""

from __future__ import annotations

# Qwen2.5-0.5B's dimensions; `layers` cuts the decoder. A test passes smaller ones.
QWEN_SHAPE = {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "vocab": 151_936}
PROMPT_TOKENS = 128
COMPLETION_TOKENS = (512, 256)  # alternating, so every micro-batch is ragged
GROUP = 8
PAD_ID = 0  # ids are drawn from [3, vocab): padding never collides with a real token


def build_model(dims: dict, layers: int):
    """A random fp32 Qwen2 of `dims` with `layers` decoder layers and tied embeddings (seed 0), or the
    real model at `dims["path"]` (a model point such as `--model smollm2`: its own layers, in fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if "path" in dims:
        return AutoModelForCausalLM.from_pretrained(dims["path"], dtype=torch.float32)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                         num_hidden_layers=layers, num_attention_heads=dims["heads"],
                         num_key_value_heads=dims["kv_heads"], tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def memory_batch(sequences: int, vocab: int, prompt_tokens: int = PROMPT_TOKENS,
                 completion_tokens: tuple[int, ...] = COMPLETION_TOKENS):
    """`(rows, rewards_PG)`: `sequences` (prompt ids, completion ids) pairs, completion lengths
    cycling through `completion_tokens`, and one reward per row in groups of `GROUP` (seed 0)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist(),
             torch.randint(3, vocab, (completion_tokens[i % len(completion_tokens)],), generator=g).tolist())
            for i in range(sequences)]
    return rows, torch.rand(sequences // GROUP, GROUP, generator=g)


def trl_generation_batch(rows: list[tuple[list[int], list[int]]], rewards_PG) -> dict:
    """The dict TRL's `GRPOTrainer._generate_and_score_completions` returns for `rows`: left-padded
    prompts, right-padded completions (both with masks), group-normalised advantages (TRL's:
    sample std, + 1e-4) and the completion-token count the "dapo" loss divides by. With one
    optimizer step per generation batch TRL passes no old log-probs (it uses the loss's own)."""
    import torch

    prompt_width = max(len(p) for p, _ in rows)
    completion_width = max(len(c) for _, c in rows)
    prompt_ids_BT = torch.full((len(rows), prompt_width), PAD_ID, dtype=torch.long)
    prompt_mask_BT = torch.zeros_like(prompt_ids_BT)
    completion_ids_BC = torch.full((len(rows), completion_width), PAD_ID, dtype=torch.long)
    completion_mask_BC = torch.zeros_like(completion_ids_BC)
    for b, (prompt, completion) in enumerate(rows):
        prompt_ids_BT[b, prompt_width - len(prompt):] = torch.tensor(prompt)
        prompt_mask_BT[b, prompt_width - len(prompt):] = 1
        completion_ids_BC[b, :len(completion)] = torch.tensor(completion)
        completion_mask_BC[b, :len(completion)] = 1
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    advantages_B = (centred_PG / (rewards_PG.std(dim=1, keepdim=True) + 1e-4)).flatten()
    return {"prompt_ids": prompt_ids_BT, "prompt_mask": prompt_mask_BT, "completion_ids": completion_ids_BC,
            "completion_mask": completion_mask_BC, "advantages": advantages_B,
            "num_items_in_batch": completion_mask_BC.sum()}


def unpadded_rows(generation_batch: dict) -> list[tuple[list[int], list[int]]]:
    """`rows` back from a `trl_generation_batch` (what the TRL side trained on, for comparing)."""
    out = []
    for prompt_ids, prompt_mask, completion_ids, completion_mask in zip(
            generation_batch["prompt_ids"], generation_batch["prompt_mask"], generation_batch["completion_ids"],
            generation_batch["completion_mask"]):
        out.append((prompt_ids[prompt_mask.bool()].tolist(), completion_ids[completion_mask.bool()].tolist()))
    return out
