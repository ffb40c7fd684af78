"""graft.rl.logprobs: token log-probs and entropy, and the one teacher-forced forward, whose chunked
LM head must give what the full-logits formula gives (values and LoRA gradients, 1e-6 in fp32).

Shape suffixes: see graft/__init__.py.
"""

import math

import pytest
import torch

from graft.rl.logprobs import sequence_logprobs, teacher_forced_logprobs, token_logprobs_and_entropy
from graft.rl.packing import completion_rows, pack, pad
from tests.helpers import trained_like_peft_model


def token_logprobs(logits_xV, tokens_x):
    return token_logprobs_and_entropy(logits_xV, tokens_x, with_entropy=False)[0]


def token_entropy(logits_xV):
    return token_logprobs_and_entropy(logits_xV, logits_xV.new_zeros(logits_xV.shape[:-1], dtype=torch.long))[1]


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


def _full_logits_formula(model, input_ids_BT, attention_mask_BT):
    """The unchunked formula the update used before: every position's [V] logits at once."""
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits
    targets_BT = torch.roll(input_ids_BT, shifts=-1, dims=-1)
    return token_logprobs(logits_BTV, targets_BT), token_entropy(logits_BTV)


@pytest.mark.parametrize("recompute_head", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 3, None])
def test_chunked_head_equals_the_full_logits_formula_values_and_lora_gradients(model, chunk_tokens, recompute_head):
    """Log-probs, entropy and the LoRA gradients of a loss using both (an entropy bonus) equal the
    unchunked formula's to 1e-6 in fp32, whatever the chunk size (1: every position its own chunk),
    the head's logits recomputed in the backward or its log-softmax kept (the hand-written backward
    either way)."""
    input_ids_BT, attention_mask_BT, mask_BT = pad(SEQUENCES, "right", pad_id=0)
    params = [p for n, p in model.named_parameters() if ".lora_" in n]

    def loss_and_grads(logprobs_BT, entropy_BT):
        loss = torch.where(mask_BT, logprobs_BT * 0.7 - 0.01 * entropy_BT, 0.0).sum()
        grads = torch.autograd.grad(loss, params)
        return logprobs_BT[mask_BT], entropy_BT[mask_BT], grads

    positions_K = mask_BT.any(0).nonzero()[:, 0]
    new = loss_and_grads(*teacher_forced_logprobs(model, input_ids_BT, attention_mask_BT, positions_K=positions_K,
                                                  with_entropy=True, chunk_tokens=chunk_tokens,
                                                  recompute_head=recompute_head))
    old = loss_and_grads(*_full_logits_formula(model, input_ids_BT, attention_mask_BT))
    torch.testing.assert_close(new[0], old[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(new[1], old[1], atol=1e-6, rtol=1e-6)  # entropy ~ log V: relative
    for got, want in zip(new[2], old[2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert any(g.abs().max() > 0 for g in new[2])


@pytest.mark.parametrize("layout", ["padded, score mask", "packed"])
def test_score_mask_and_packed_rows_equal_the_full_logits_formula(model, layout):
    """Per-row score masks (the head skips other rows' positions) and packed rows (position ids
    restarting, no attention mask: transformers keeps attention inside each sequence) give each
    sequence's completion log-probs, entropies and LoRA gradients of the full-logits formula."""
    input_ids_BT, attention_mask_BT, mask_BT = pad(SEQUENCES, "right", pad_id=0)
    lens = [len(c) for _, c in SEQUENCES]
    params = [p for n, p in model.named_parameters() if ".lora_" in n]

    def rows_and_grads(logprobs_xT, entropy_xT, mask_xT):
        logprobs_BC = completion_rows(logprobs_xT, mask_xT, lens)
        entropy_BC = completion_rows(entropy_xT, mask_xT, lens)
        grads = torch.autograd.grad((logprobs_BC * 0.7 - 0.01 * entropy_BC).sum(), params)
        return logprobs_BC, entropy_BC, grads

    if layout == "packed":
        packed = pack(SEQUENCES)
        ids_1N, mask_1N = packed.input_ids_N[None], packed.completion_mask_N[None]
        new = rows_and_grads(*teacher_forced_logprobs(
            model, ids_1N, positions_K=mask_1N[0].nonzero()[:, 0], with_entropy=True, chunk_tokens=2,
            position_ids_BT=packed.position_ids_N[None]), mask_1N)
    else:
        scored_BT = teacher_forced_logprobs(model, input_ids_BT, attention_mask_BT, with_entropy=True,
                                            chunk_tokens=2, score_mask_BT=mask_BT)
        assert (scored_BT.logprobs_BT[~mask_BT] == 0).all()  # the head ran at completion positions only
        new = rows_and_grads(*scored_BT, mask_BT)
    old = rows_and_grads(*_full_logits_formula(model, input_ids_BT, attention_mask_BT), mask_BT)
    torch.testing.assert_close(new[0], old[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(new[1], old[1], atol=1e-5, rtol=1e-6)
    for got, want in zip(new[2], old[2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("prompt", "completion"), SEQUENCES)
def test_one_sequence_equals_the_engine_formula_it_replaced(model, prompt, completion):
    """`graft.rollout.reference.sequence_logprobs` before the move, written out (all logits at once)."""
    with torch.no_grad():
        ids_1T = torch.tensor([prompt + completion])
        logits_CV = model(input_ids=ids_1T, use_cache=False).logits[0, len(prompt) - 1:-1].float()
        old_C = torch.log_softmax(logits_CV, dim=-1).gather(-1, ids_1T[0, len(prompt):][:, None])[:, 0]
    new = sequence_logprobs(model, prompt, completion)
    torch.testing.assert_close(torch.tensor(new), old_C, atol=1e-6, rtol=0)


def test_the_head_is_left_as_it_was(model):
    head = model.get_output_embeddings()
    input_ids_BT, attention_mask_BT, _ = pad(SEQUENCES, "right", pad_id=0)
    with torch.no_grad():
        teacher_forced_logprobs(model, input_ids_BT, attention_mask_BT)
        logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
    assert "forward" not in head.__dict__ and logits_BTV.shape[-1] == head.weight.shape[0]


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
