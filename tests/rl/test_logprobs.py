"""graft.rl.logprobs: token log-probs and entropy, and the one teacher-forced forward, which must give
bit for bit what the update and the reference engine computed before they shared it.

Shape suffixes: ``_B`` batch rows, ``_T`` tokens, ``_V`` vocabulary, ``_C`` completion tokens.
"""

import math

import pytest
import torch

from graft.rl.logprobs import sequence_logprobs, teacher_forced_logprobs, token_entropy, token_logprobs
from graft.rl.packing import pad
from tests.helpers import trained_like_peft_model

SEQUENCES = [([5, 9, 11], [12, 40, 41, 2]), ([7, 8, 9, 10, 11, 12], [3]), ([4], [99, 100, 101, 102, 103, 104])]


@pytest.fixture(scope="module")
def model(base_dir):
    return trained_like_peft_model(base_dir)


def test_token_logprobs_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 5, 11, generator=g).to(torch.bfloat16)
    tokens_BT = torch.randint(0, 11, (2, 5), generator=g)
    logprobs_BT = token_logprobs(logits_BTV, tokens_BT)
    assert logprobs_BT.dtype == torch.float32
    probs_BTV = torch.softmax(logits_BTV.double(), -1)
    expected_BT = probs_BTV.gather(-1, tokens_BT[..., None]).squeeze(-1).log()
    torch.testing.assert_close(logprobs_BT.double(), expected_BT, atol=1e-6, rtol=0)
    entropy_BT = token_entropy(logits_BTV)
    assert entropy_BT.dtype == torch.float32
    torch.testing.assert_close(entropy_BT.double(), -(probs_BTV * probs_BTV.log()).sum(-1), atol=1e-5, rtol=0)
    uniform = token_entropy(torch.zeros(1, 1, 11))
    torch.testing.assert_close(uniform, torch.full((1, 1), math.log(11)))


def test_padded_batch_is_bit_identical_to_the_update_formula_it_replaced(model):
    """`graft.train.update._completion_logprobs` before the move, written out."""
    input_ids_BT, attention_mask_BT, _ = pad(SEQUENCES, "right", pad_id=0)
    logprobs_BT, logits_BTV = teacher_forced_logprobs(model, input_ids_BT, attention_mask_BT)
    old_logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits
    old_targets_BT = torch.roll(input_ids_BT, shifts=-1, dims=-1)
    old_BT = old_logits_BTV.float().log_softmax(dim=-1).gather(dim=-1, index=old_targets_BT.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(logits_BTV, old_logits_BTV)
    assert torch.equal(logprobs_BT, old_BT)
    assert logprobs_BT.requires_grad  # the update differentiates through it


@pytest.mark.parametrize(("prompt", "completion"), SEQUENCES)
def test_one_sequence_is_bit_identical_to_the_engine_formula_it_replaced(model, prompt, completion):
    """`graft.rollout.reference.sequence_logprobs` before the move, written out."""
    with torch.no_grad():
        ids_1T = torch.tensor([prompt + completion])
        logits_CV = model(input_ids=ids_1T, use_cache=False).logits[0, len(prompt) - 1:-1].float()
        old_C = torch.log_softmax(logits_CV, dim=-1).gather(-1, ids_1T[0, len(prompt):][:, None])[:, 0]
    new = sequence_logprobs(model, prompt, completion)
    assert torch.equal(torch.tensor(new), old_C)
    assert new == old_C.tolist()


def test_one_sequence_agrees_with_its_row_of_a_padded_batch(model):
    input_ids_BT, attention_mask_BT, completion_mask_BT = pad(SEQUENCES, "right", pad_id=0)
    with torch.no_grad():
        logprobs_BT, _ = teacher_forced_logprobs(model, input_ids_BT, attention_mask_BT)
    for b, (prompt, completion) in enumerate(SEQUENCES):
        row_C = logprobs_BT[b, completion_mask_BT[b]]
        torch.testing.assert_close(torch.tensor(sequence_logprobs(model, prompt, completion)), row_C,
                                   atol=1e-5, rtol=0)


def test_one_sequence_needs_a_prompt_and_may_have_no_completion(model):
    assert sequence_logprobs(model, [5, 6], []) == []
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        sequence_logprobs(model, [], [5])
