"""Teacher-forced log-probs: what a causal LM assigns to tokens it is given, not tokens it samples.

One forward pass over the given ids; the LM head runs only at the positions asked for, a chunk of
positions at a time, and each chunk's log-softmax (float32) is gathered at the next token — the
``[tokens, vocab]`` logits of a whole batch never exist, forward or backward. It is the single
place graft computes these numbers, so the policy update (old, reference and current policy),
delivery verification and the reference engine's checks all compare like with like: the quantity
inference engines report per sampled token (vLLM's ``raw_logprobs``: no temperature, no top-p).

Shape suffixes: see graft/__init__.py.
Alignment: the logits at position ``t`` score token ``t + 1`` (see ``graft.rl.packing``).
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from graft.rl.packing import next_token_targets

# fp32 logits per chunk: positions x V elements (64 MiB); a 151,936-token vocabulary gives 110-token chunks.
# Forward and backward hold several such buffers (logits, log-softmax, its exp, their gradients).
# Measured on the 2-layer Qwen2.5-0.5B shape (32 sequences, 16,384 completion tokens): 256 MiB
# chunks peaked 4.5 GiB above the model, 64-token chunks 2.5 GiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


class TeacherForced(NamedTuple):
    """One teacher-forced forward's results, float32, ``[B, T]``.

    Attributes:
        logprobs_BT: log-prob of the next token at each scored position; 0 at positions not scored.
        entropy_BT: entropy of the next-token distribution at each scored position when asked for
            (with its graph when gradients are on); 0 elsewhere.
    """

    logprobs_BT: Tensor
    entropy_BT: Tensor


def token_logprobs_and_entropy(logits_xV: Tensor, tokens_x: Tensor, with_entropy: bool = True
                               ) -> tuple[Tensor, Tensor]:
    """``log_softmax(logits)[token]`` and the entropy ``-sum_v p_v log p_v`` per position, float32,
    from one log-softmax (the entropy is zeros without ``with_entropy``).

    The caller aligns: ``tokens_x[i]`` must be the token that the logits at ``i`` predict (the next
    token; see ``graft.rl.packing.next_token_targets``).
    """
    logprobs_xV = logits_xV.float().log_softmax(dim=-1)
    logprob_x = logprobs_xV.gather(dim=-1, index=tokens_x.unsqueeze(-1)).squeeze(-1)
    entropy_x = -(logprobs_xV.exp() * logprobs_xV).sum(dim=-1) if with_entropy else torch.zeros_like(logprob_x)
    return logprob_x, entropy_x


class _ScoresFromLogits(torch.autograd.Function):
    """``[N, 2]``: (log-prob of the target, entropy) from ``[N, V]`` logits, as
    ``token_logprobs_and_entropy`` computes them, with a hand-written backward that keeps one
    ``[N, V]`` float32 tensor (the log-softmax) instead of autograd's four (float copy, log-softmax,
    its exp, their product) and builds the logits' gradient in place:
    ``d logits = g_lp * (onehot - p) - g_ent * p * (log p + H)``. Measured on the 2-layer
    Qwen2.5-0.5B shape (8 x 256 completion tokens): the head's elementwise ops took 5.5 of the
    update's 38.7 profiled seconds through autograd."""

    @staticmethod
    def forward(ctx, logits_NV: Tensor, targets_N: Tensor, with_entropy: bool) -> Tensor:
        logprobs_NV = logits_NV.float().log_softmax(dim=-1)
        logprob_N = logprobs_NV.gather(dim=-1, index=targets_N.unsqueeze(-1)).squeeze(-1)
        entropy_N = (-(logprobs_NV.exp() * logprobs_NV).sum(dim=-1) if with_entropy
                     else torch.zeros_like(logprob_N))
        ctx.save_for_backward(logprobs_NV, targets_N, entropy_N)
        ctx.with_entropy, ctx.logits_dtype = with_entropy, logits_NV.dtype
        return torch.stack((logprob_N, entropy_N), dim=-1)

    @staticmethod
    def backward(ctx, grad_N2: Tensor):
        logprobs_NV, targets_N, entropy_N = ctx.saved_tensors
        grad_lp_N1, grad_ent_N1 = grad_N2[:, :1].float(), grad_N2[:, 1:].float()
        grad_NV = logprobs_NV.exp()  # p
        if ctx.with_entropy and bool(grad_ent_N1.any()):  # an entropy bonus: the entropy has a gradient
            grad_NV.mul_((logprobs_NV + entropy_N[:, None]).mul_(grad_ent_N1).add_(grad_lp_N1))
        else:
            grad_NV.mul_(grad_lp_N1)
        grad_NV.neg_().scatter_add_(-1, targets_N[:, None], grad_lp_N1)
        return grad_NV.to(ctx.logits_dtype), None, None


def _score_chunk(head_forward, hidden_NH: Tensor, targets_N: Tensor, with_entropy: bool) -> Tensor:
    """``[N, 2]``: (log-prob of the target, entropy) for a chunk of N positions; the ``[N, V]`` logits
    live only inside this call, and with gradients its log-softmax until the backward."""
    return _ScoresFromLogits.apply(head_forward(hidden_NH), targets_N, with_entropy)


def _chunked_head(head_forward, targets_BK: Tensor, chunk_tokens: int, with_entropy: bool,
                  keep_BK: Tensor | None = None, recompute: bool = True):
    """A stand-in for the LM head's forward: ``hidden_BKH -> [B, K, 2]`` scores, chunk by chunk.

    With ``keep_BK`` only those positions are scored (the rest stay 0): rows of a padded batch
    share the columns ``K``, but each row needs only its own completion's. With gradients on and
    ``recompute``, each chunk is recomputed in the backward pass (``checkpoint``): only its hidden
    states are kept, so the backward never holds more than one chunk's logits either. Without
    ``recompute`` each chunk keeps its ``[N, V]`` float32 log-softmax for the backward (V x 4 bytes
    per scored position) and the head's matmul runs twice instead of three times.
    """
    def forward(hidden_BKH: Tensor) -> Tensor:
        b, k, h = hidden_BKH.shape
        hidden_NH, targets_N = hidden_BKH.reshape(b * k, h), targets_BK.reshape(b * k)
        if keep_BK is not None:
            keep_N1 = keep_BK.reshape(b * k, 1)
            hidden_NH, targets_N = hidden_NH[keep_N1[:, 0]], targets_N[keep_N1[:, 0]]
        scores = [hidden_NH.new_zeros(0, 2, dtype=torch.float32)]
        for start in range(0, len(targets_N), chunk_tokens):
            chunk = (hidden_NH[start:start + chunk_tokens], targets_N[start:start + chunk_tokens])
            if recompute and torch.is_grad_enabled() and hidden_NH.requires_grad:
                scores.append(checkpoint(_score_chunk, head_forward, *chunk, with_entropy, use_reentrant=False))
            else:
                scores.append(_score_chunk(head_forward, *chunk, with_entropy))
        scores_N2 = torch.cat(scores)
        if keep_BK is not None:
            scores_N2 = scores_N2.new_zeros(b * k, 2).masked_scatter(keep_N1.expand(-1, 2), scores_N2)
        return scores_N2.view(b, k, 2)
    return forward


def teacher_forced_logprobs(model: nn.Module, input_ids_BT: Tensor, attention_mask_BT: Tensor | None = None, *,
                            positions_K: Tensor | None = None, with_entropy: bool = False,
                            chunk_tokens: int | None = None, position_ids_BT: Tensor | None = None,
                            score_mask_BT: Tensor | None = None, recompute_head: bool = True) -> TeacherForced:
    """One forward of ``model`` over ``input_ids_BT``, scoring each position's next token.

    The LM head runs only at ``positions_K`` (e.g. those that predict a completion token), in chunks
    of ``chunk_tokens`` positions, so no ``[tokens, vocab]`` tensor of the whole batch ever exists:
    during the forward the head's module is given a chunked forward that returns log-prob and
    entropy instead of logits (HF models pass ``logits_to_keep`` positions to their head). Gradients
    flow unless the caller runs under ``torch.no_grad()``. ``model`` is used as it is (for a
    PeftModel: whichever adapter is active, or none inside ``disable_adapter``).

    Args:
        model: A Hugging Face causal LM (or a PeftModel of one).
        input_ids_BT: Token ids; right padding needs no ``position_ids`` (HF's ``arange`` is right).
        attention_mask_BT: 1/0 mask for a padded batch; None for unpadded rows (HF's default).
        positions_K: Increasing positions to score; None = every position but the last. Moved to
            ``input_ids_BT``'s device (the model's) if it is elsewhere.
        with_entropy: Also compute each scored position's entropy.
        chunk_tokens: Positions per LM-head chunk; None = ``DEFAULT_CHUNK_ELEMENTS // vocab``.
        position_ids_BT: For packed rows (``graft.rl.packing.pack``): positions restarting at 0 per
            sequence, with ``attention_mask_BT`` None. No KV cache is built (``use_cache=False``), so
            transformers reads the restarts as sequence boundaries and keeps attention inside each
            sequence (a block-diagonal mask for sdpa/eager, varlen for flash-attention); with a cache
            it would not, and tokens would attend to the sequences packed before them.
        score_mask_BT: Score only where True (within ``positions_K``; e.g. each row's completion
            positions): the LM head, the costliest per token at a real vocabulary, skips the other
            rows' positions in the shared columns; those stay 0.
        recompute_head: With gradients, recompute each chunk's logits in the backward (the least
            memory); False keeps each scored position's float32 log-softmax (V x 4 bytes) instead.
    """
    t = input_ids_BT.shape[1]
    if positions_K is None:
        positions_K = torch.arange(max(t - 1, 0), device=input_ids_BT.device)
    positions_K = positions_K.to(device=input_ids_BT.device)  # index_copy below needs it beside the ids
    targets_BK = next_token_targets(input_ids_BT)[:, positions_K]
    head = model.get_output_embeddings()
    chunk_tokens = chunk_tokens or max(1, DEFAULT_CHUNK_ELEMENTS // head.weight.shape[0])
    keep_BK = score_mask_BT[:, positions_K] if score_mask_BT is not None else None
    chunked = _chunked_head(head.forward, targets_BK, chunk_tokens, with_entropy, keep_BK, recompute_head)
    with _head_forward_replaced(head, chunked):
        scores_BK2 = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids_BT,
                           use_cache=False, logits_to_keep=positions_K).logits
    logprobs_BT = input_ids_BT.new_zeros(input_ids_BT.shape, dtype=torch.float32)
    entropy_BT = torch.zeros_like(logprobs_BT)
    logprobs_BT = logprobs_BT.index_copy(1, positions_K, scores_BK2[..., 0])
    entropy_BT = entropy_BT.index_copy(1, positions_K, scores_BK2[..., 1])
    return TeacherForced(logprobs_BT, entropy_BT)


@contextlib.contextmanager
def _head_forward_replaced(head: nn.Module, forward) -> Iterator[None]:
    """``head.forward`` is ``forward`` for the body (an instance attribute: the module tree, its
    parameters and any hooks on it stay as they are)."""
    previous = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


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
    # the logits at position t predict token t + 1: the completion is predicted from len(prompt) - 1 on
    positions_K = torch.arange(len(prompt_ids) - 1, ids_1T.shape[1] - 1, device=device)
    logprobs_1T, _ = teacher_forced_logprobs(model, ids_1T, positions_K=positions_K)
    return logprobs_1T[0, positions_K].tolist()
