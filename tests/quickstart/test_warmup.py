"""The SFT base model: deterministic short training, the loss mask, saving, and greedy scoring."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft.models.tokenizer import train_tokenizer
from graft.quickstart import warmup
from graft.quickstart.warmup import (
    IGNORE_INDEX,
    PROBE_EVERY,
    PROBE_EVERY_NEAR,
    collate_sft,
    generate_completions,
    greedy_accuracy,
    sft_base_model,
    sft_sequence,
)
from graft.tasks import Example, render_prompt_ids
from graft.tasks.arithmetic import arithmetic_task

SMALL = {
    "hidden": 64,
    "layers": 2,
    "steps": 30,
    "batch": 16,
    "lr": 3e-3,
    "seed": 0,
    "task_kwargs": {"max_operand": 20, "n_train": 200, "n_eval": 20},
    "target_accuracy": None,
    "progress": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def sft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    return sft_base_model(root / "a", **SMALL), sft_base_model(root / "b", **SMALL)


def test_same_seed_gives_identical_weights_and_losses(sft_dirs):
    a, b = sft_dirs
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert all(w.dtype == torch.float32 for w in weights_a.values())
    assert json.loads((a / "sft.json").read_text())["losses"] == json.loads((b / "sft.json").read_text())["losses"]


def test_loss_decreases(sft_dirs):
    losses = json.loads((sft_dirs[0] / "sft.json").read_text())["losses"]
    assert len(losses) == SMALL["steps"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_saved_dir_loads_with_auto_classes(sft_dirs):
    model = AutoModelForCausalLM.from_pretrained(sft_dirs[0], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(sft_dirs[0])
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size == SMALL["hidden"]
    assert model.generation_config.eos_token_id == tok.eos_token_id
    _, eval_set = arithmetic_task(**SMALL["task_kwargs"])
    assert 0.0 <= greedy_accuracy(model, tok, eval_set[:8]) <= 1.0


def test_target_accuracy_stops_at_the_first_probe_that_reaches_it(tmp_path):
    reached = sft_base_model(tmp_path / "reached", **{**SMALL, "target_accuracy": 0.0})
    record = json.loads((reached / "sft.json").read_text())
    assert record["steps_run"] == len(record["losses"]) == PROBE_EVERY
    assert [step for step, _ in record["probe_accuracy"]] == [PROBE_EVERY]
    never = sft_base_model(tmp_path / "never", **{**SMALL, "steps": 2 * PROBE_EVERY + 3, "target_accuracy": 1.01})
    record = json.loads((never / "sft.json").read_text())
    assert record["steps_run"] == 2 * PROBE_EVERY + 3
    assert [step for step, _ in record["probe_accuracy"]] == [PROBE_EVERY, 2 * PROBE_EVERY]
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in record["probe_accuracy"])


def test_probes_every_step_once_above_half_the_target(tmp_path, monkeypatch):
    scripted = iter([0.1, 0.3, 0.45, 0.2, 0.5])  # 0.3 and 0.45 are above half of 0.5: the next probe is near
    monkeypatch.setattr(warmup, "greedy_accuracy", lambda *args, **kwargs: next(scripted))
    out = sft_base_model(tmp_path / "m", **{**SMALL, "steps": 200, "target_accuracy": 0.5})
    record = json.loads((out / "sft.json").read_text())
    steps = [PROBE_EVERY, 2 * PROBE_EVERY]
    steps += [steps[-1] + PROBE_EVERY_NEAR, steps[-1] + 2 * PROBE_EVERY_NEAR]
    steps.append((steps[-1] // PROBE_EVERY + 1) * PROBE_EVERY)  # 0.2 is below half the target again
    assert record["probe_accuracy"] == [[step, a] for step, a in zip(steps, [0.1, 0.3, 0.45, 0.2, 0.5])]
    assert record["steps_run"] == steps[-1]


def test_refuses_a_non_empty_out_dir(tmp_path):
    (tmp_path / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        sft_base_model(tmp_path, **SMALL)


def test_loss_mask_covers_exactly_the_answer_and_eos(tokenizer):
    examples = [
        Example("What is 3 + 4? Answer with the number only.", "7"),
        Example("What is 10 + 95? Answer with the number only.", "105"),
    ]
    sequences = [sft_sequence(tokenizer, ex) for ex in examples]
    input_ids_BT, labels_BT, attention_mask_BT = collate_sft(sequences, tokenizer.pad_token_id)
    for i, ex in enumerate(examples):
        prompt = render_prompt_ids(tokenizer, ex)
        answer = tokenizer.encode(ex.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        n = len(prompt) + len(answer)
        assert input_ids_BT[i, :n].tolist() == prompt + answer
        assert attention_mask_BT[i].tolist() == [1] * n + [0] * (input_ids_BT.shape[1] - n)
        supervised = (labels_BT[i] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert supervised == list(range(len(prompt), n))
        assert labels_BT[i, supervised].tolist() == answer
        assert tokenizer.decode(labels_BT[i, supervised]) == ex.answer + "<|im_end|>"
        assert input_ids_BT[i, n:].tolist() == [tokenizer.pad_token_id] * (input_ids_BT.shape[1] - n)


class _ScriptedModel:
    """Stands in for a causal LM: "generates" a fixed reply per prompt, after checking that prompts
    arrive left-padded with a matching attention mask."""

    def __init__(self, tokenizer, replies: dict[str, str]):
        self.tokenizer, self.replies = tokenizer, replies

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **_):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            n_pad = mask.count(0)
            assert mask == [0] * n_pad + [1] * (len(mask) - n_pad)  # left padding
            assert ids[:n_pad] == [pad_token_id] * n_pad
            prompt = self.tokenizer.decode(ids[n_pad:])
            reply = next(r for p, r in self.replies.items() if p in prompt)
            new = (self.tokenizer.encode(reply, add_special_tokens=False) + [eos_token_id])[:max_new_tokens]
            rows.append(ids + new + [pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_greedy_accuracy_scores_a_scripted_model(tokenizer):
    examples = [
        Example("What is 1 + 2?", "3"),
        Example("What is 40 + 45?", "85"),
        Example("What is 100 + 23?", "123"),
        Example("What is 7 + 7?", "14"),
    ]
    model = _ScriptedModel(tokenizer, {"1 + 2": "3", "40 + 45": "84", "100 + 23": "123", "7 + 7": "fourteen"})
    assert generate_completions(model, tokenizer, examples) == [["3"], ["84"], ["123"], ["fourteen"]]
    assert greedy_accuracy(model, tokenizer, examples) == 0.5
    assert greedy_accuracy(model, tokenizer, []) == 0.0


def test_batched_greedy_matches_one_prompt_at_a_time(sft_dirs):
    model = AutoModelForCausalLM.from_pretrained(sft_dirs[0], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(sft_dirs[0])
    # Operands of 1 and 2 digits give prompts of different lengths, so the batch is padded.
    examples = [
        Example(f"What is {a} + {b}? Answer with the number only.", str(a + b))
        for a, b in [(3, 4), (12, 9), (7, 15), (20, 20), (0, 1)]
    ]
    batched = generate_completions(model, tok, examples)
    assert batched == [generate_completions(model, tok, [ex])[0] for ex in examples]
