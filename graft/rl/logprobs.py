"""Teacher-forced log-probs: what a causal LM assigns to tokens it is given, not tokens it samples.

One forward pass over the given ids, then log-softmax of the raw logits in float32, gathered at the
next token of every position. It is the single place graft computes these numbers, so the policy
update (old, reference and current policy), delivery verification and the reference engine's checks
all compare like with like: the quantity inference engines report per sampled token (vLLM's
``raw_logprobs``: no temperature, no top-p).

Shape suffixes: ``_B`` rows, ``_T`` token positions, ``_V`` vocabulary, ``_C`` completion tokens.
Alignment: the logits at position ``t`` score token ``t + 1`` (see ``graft.rl.packing``).
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from graft.rl.packing import next_token_targets


class TeacherForced(NamedTuple):
    """One teacher-forced forward's results.

    Attributes:
        logprobs_BT: float32 log-prob of the next token at every position; the last position (and
            any whose next token is padding) holds a meaningless but finite value: select
            completion positions with a completion mask.
        logits_BTV: the raw logits in the model's dtype, with their graph (the update's entropy).
    """

    logprobs_BT: Tensor
    logits_BTV: Tensor


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor) -> Tensor:
    """``logprobs_BT[b, t] = log_softmax(logits_BTV[b, t])[tokens_BT[b, t]]``, in float32.

    The caller aligns: ``tokens_BT[b, t]`` must be the token that the logits at ``t`` predict
    (the next token; see ``graft.rl.packing.next_token_targets``).
    """
    logprobs_BTV = logits_BTV.float().log_softmax(dim=-1)
    return logprobs_BTV.gather(dim=-1, index=tokens_BT.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_BTV: Tensor) -> Tensor:
    """``entropy_BT = -sum_v p_v log p_v`` of the softmax of the logits, in float32."""
    logprobs_BTV = logits_BTV.float().log_softmax(dim=-1)
    return -(logprobs_BTV.exp() * logprobs_BTV).sum(dim=-1)


def teacher_forced_logprobs(model: nn.Module, input_ids_BT: Tensor, attention_mask_BT: Tensor | None = None
                            ) -> TeacherForced:
    """One forward of ``model`` over ``input_ids_BT``; every position's log-prob of its next token.

    Gradients flow unless the caller runs under ``torch.no_grad()``. ``model`` is used as it is (for
    a PeftModel: whichever adapter is active, or none inside ``disable_adapter``).

    The logits of every position are materialised (``[B, T, V]``). A vocabulary-chunked variant that
    applies the LM head only at completion positions would take the completion mask here and return
    the entropy in place of the logits; callers already select completion positions themselves.

    Args:
        model: A causal LM whose output has ``.logits``.
        input_ids_BT: Token ids; right padding needs no ``position_ids`` (HF's ``arange`` is right).
        attention_mask_BT: 1/0 mask for a padded batch; None for unpadded rows (HF's default).
    """
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits
    return TeacherForced(token_logprobs(logits_BTV, next_token_targets(input_ids_BT)), logits_BTV)


@torch.no_grad()
def sequence_logprobs(model: nn.Module, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """Teacher-forced log-probs of ``completion_ids`` after ``prompt_ids``: one per completion token.

    The trainer's side of every engine-vs-trainer comparison (delivery verification, engine tests).

    Raises:
        ValueError: ``prompt_ids`` is empty (the first completion token would have no context).
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; a completion log-prob needs at least one prompt token")
    if not completion_ids:
        return []
    device = next(model.parameters()).device
    ids_1T = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
    logprobs_1T, _ = teacher_forced_logprobs(model, ids_1T)
    # the logits at position t predict token t + 1: the completion is predicted from len(prompt) - 1 on
    return logprobs_1T[0, len(prompt_ids) - 1:-1].tolist()
