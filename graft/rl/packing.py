"""Laying (prompt, completion) sequences out for one forward pass: packed or padded.

Shape suffixes: see graft/__init__.py (here ``_N``: all sequences back to back in one row, ``pack``;
``_R``/``_L``: ``pack_rows``; ``_C``: ``completion_rows``, one sequence per row whatever the layout).

Alignment, the classic off-by-one: a causal LM's logits at position ``t`` score token ``t + 1``.
Every ``completion_mask`` here is True at the positions whose NEXT token is a completion token, so
with ``targets = next_token_targets(input_ids)`` and
``logprobs, _ = token_logprobs_and_entropy(logits, targets)`` the masked values are exactly the
completion tokens' log-probs, in order. A sequence of prompt length P and completion length C has
its mask at in-sequence positions ``P-1 .. P+C-2``.

Packed attention: a packed row needs ``position_ids`` that restart at 0 per sequence (given here)
AND attention restricted to each sequence's own tokens — a block-diagonal causal mask
or varlen attention (flash-attn's ``cu_seqlens``). Position ids alone do
not stop a token attending to the sequences packed before it — unless the model builds that mask
from the restarts itself (transformers does when no KV cache is in use; see
``graft.rl.logprobs.teacher_forced_logprobs``).

Back to sequences: ``completion_rows`` is the one map from a layout's per-position values to each
sequence's completion values (the place verl's #5115 misalignment class lives), used for padded and
packed layouts alike; ``completion_rows_mask`` marks its valid entries.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

Sequence = tuple[list[int], list[int]]  # (prompt ids, completion ids)

PAD_SIDES = ("left", "right")


@dataclass(frozen=True)
class Packed:
    """Sequences concatenated into one row of N tokens, no padding.

    Attributes:
        input_ids_N: prompt + completion of each sequence, back to back (int64).
        position_ids_N: 0, 1, ... restarting at every sequence start (int64).
        completion_mask_N: True where the next token is a completion token of the same sequence.
        seq_lens: Tokens per sequence (prompt + completion).
        completion_lens: Completion tokens per sequence.
    """

    input_ids_N: Tensor
    position_ids_N: Tensor
    completion_mask_N: Tensor
    seq_lens: list[int]
    completion_lens: list[int]


def _check(sequences: list[Sequence]) -> None:
    if not sequences:
        raise ValueError("no sequences to lay out")
    for i, (prompt, _) in enumerate(sequences):
        # The first completion token is scored by the logits at the last prompt token.
        if not prompt:
            raise ValueError(f"sequence {i} has an empty prompt; its first completion token has no predictor")


def _completion_mask(prompt_len: int, completion_len: int) -> Tensor:
    """``mask_T`` for one sequence of ``T = P + C`` tokens: True at ``P-1 .. P+C-2``."""
    mask_T = torch.zeros(prompt_len + completion_len, dtype=torch.bool)
    mask_T[prompt_len - 1 : prompt_len - 1 + completion_len] = True
    return mask_T


def next_token_targets(input_ids_xT: Tensor) -> Tensor:
    """``targets[..., t] = input_ids[..., t + 1]``: the token the logits at ``t`` score.

    The last position wraps around to the row's first token (a valid index); it is never under a
    completion mask, nor is any position whose next token belongs to another sequence or padding.
    """
    return torch.roll(input_ids_xT, shifts=-1, dims=-1)


def pack(sequences: list[Sequence]) -> Packed:
    """Packs ``(prompt, completion)`` pairs into one row (see ``Packed``).

    Raises:
        ValueError: If there are no sequences or a prompt is empty.
    """
    _check(sequences)
    ids, positions, masks = [], [], []
    for prompt, completion in sequences:
        ids.append(torch.tensor(prompt + completion, dtype=torch.long))
        positions.append(torch.arange(len(prompt) + len(completion)))
        masks.append(_completion_mask(len(prompt), len(completion)))
    return Packed(
        input_ids_N=torch.cat(ids),
        position_ids_N=torch.cat(positions),
        completion_mask_N=torch.cat(masks),
        seq_lens=[len(p) + len(c) for p, c in sequences],
        completion_lens=[len(c) for _, c in sequences],
    )


@dataclass(frozen=True)
class PackedRows:
    """Sequences packed into ``R`` rows of ``L`` tokens: each row holds whole sequences back to back
    (position ids restarting), its unused tail is a stand-in sequence of ``pad_id`` (position ids
    restarting too, so nothing real attends to it) — see ``pack_rows``.

    Attributes:
        input_ids_RL, position_ids_RL, completion_mask_RL: As ``Packed``'s, one row each.
        order: The sequences' indices in layout order (row-major): the order of ``completion_rows``.
    """

    input_ids_RL: Tensor
    position_ids_RL: Tensor
    completion_mask_RL: Tensor
    order: list[int]


def first_fit_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``row_tokens`` (at least the longest): first fit,
    longest first; each row's indices in increasing order."""
    row_tokens = max(row_tokens, *lengths)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = next((r for r, f in enumerate(free) if lengths[i] <= f), None)
        if fits is None:
            rows.append([i])
            free.append(row_tokens - lengths[i])
        else:
            rows[fits].append(i)
            free[fits] -= lengths[i]
    return [sorted(row) for row in rows]


def pack_rows(sequences: list[Sequence], row_tokens: int, pad_id: int) -> PackedRows:
    """Packs sequences into rows of at most ``max(row_tokens, longest sequence)`` tokens
    (``first_fit_rows``); ``L`` is the fullest row's length.

    With ``row_tokens`` the longest sequence, a packed batch never has more rows than a padded one,
    nor longer ones: attention (and a block-diagonal mask, ``R x L x L``) costs at most padding's,
    while short sequences share rows instead of computing padding.

    Raises:
        ValueError: If there are no sequences or a prompt is empty.
    """
    _check(sequences)
    lengths = [len(p) + len(c) for p, c in sequences]
    rows = first_fit_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids, positions, masks = [], [], []
    for row in rows:
        packed = pack([sequences[i] for i in row])
        tail = width - len(packed.input_ids_N)
        ids.append(torch.cat([packed.input_ids_N, torch.full((tail,), pad_id, dtype=torch.long)]))
        positions.append(torch.cat([packed.position_ids_N, torch.arange(tail)]))
        masks.append(torch.cat([packed.completion_mask_N, torch.zeros(tail, dtype=torch.bool)]))
    return PackedRows(torch.stack(ids), torch.stack(positions), torch.stack(masks), [i for row in rows for i in row])


def pad(sequences: list[Sequence], side: str, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pads ``(prompt, completion)`` pairs to one ``[B, T]`` batch, T the longest sequence.

    Left padding needs explicit ``position_ids`` (0, 1, ... over each row's real tokens); HF's default
    ``arange`` would shift every left-padded sequence's positions.

    Returns:
        ``(input_ids_BT, attention_mask_BT, completion_mask_BT)``: int64 ids, int64 1/0 attention
        mask, and a bool mask True where the next token is a completion token.

    Raises:
        ValueError: If ``side`` is not "left"/"right", there are no sequences or a prompt is empty.
    """
    if side not in PAD_SIDES:
        raise ValueError(f"pad side must be one of {PAD_SIDES}, got {side!r}")
    _check(sequences)
    t = max(len(p) + len(c) for p, c in sequences)
    input_ids_BT = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros(len(sequences), t, dtype=torch.long)
    completion_mask_BT = torch.zeros(len(sequences), t, dtype=torch.bool)
    for b, (prompt, completion) in enumerate(sequences):
        n = len(prompt) + len(completion)
        cols = slice(t - n, t) if side == "left" else slice(0, n)
        input_ids_BT[b, cols] = torch.tensor(prompt + completion, dtype=torch.long)
        attention_mask_BT[b, cols] = 1
        completion_mask_BT[b, cols] = _completion_mask(len(prompt), len(completion))
    return input_ids_BT, attention_mask_BT, completion_mask_BT


def completion_rows_mask(completion_lens: list[int], device: torch.device | None = None) -> Tensor:
    """``mask_BC``: True at the first ``completion_lens[b]`` entries of row ``b``."""
    lens_B = torch.tensor(completion_lens, dtype=torch.long, device=device)
    width = max(completion_lens, default=0)
    return torch.arange(width, device=device)[None, :] < lens_B[:, None]


def completion_rows(values_xT: Tensor, completion_mask_xT: Tensor, completion_lens: list[int]) -> Tensor:
    """Each sequence's completion values as one row of a ``[B, C]`` grid, zero after its end.

    Works for a padded batch (one sequence per row) and packed rows (several sequences per row)
    alike: both completion masks, read row-major, list every sequence's completion positions
    sequence after sequence, in order — so row ``b`` of the result is sequence ``b``'s values
    whatever the layout, and a loss over ``[B, C]`` (per-sequence advantages, per-sequence means)
    is layout-free. Differentiable (gradients flow back to ``values_xT``).

    Args:
        values_xT: Per-position values (log-probs of the next token, entropy...), ``[B, T]`` or ``[1, N]``.
        completion_mask_xT: The layout's completion mask (``pad``'s or ``Packed.completion_mask_N[None]``).
        completion_lens: Completion tokens per sequence, in layout order.
    """
    assert values_xT.shape == completion_mask_xT.shape, "values do not match the layout"
    flat = values_xT[completion_mask_xT]
    assert flat.numel() == sum(completion_lens), "the completion mask does not match the completion lengths"
    mask_BC = completion_rows_mask(completion_lens, values_xT.device)
    return values_xT.new_zeros(mask_BC.shape).masked_scatter(mask_BC, flat)


@dataclass(frozen=True)
class SharedPromptRows:
    """Sequences in ``R`` rows of ``L`` tokens where the sequences of one prompt share its tokens:
    the prompt but its last token once (the prefix), then per sequence a branch — the prompt's last
    token and the completion — that attends to the prefix and to itself (``pack_shared_prompts``).

    Attributes:
        input_ids_RL, position_ids_RL, completion_mask_RL: As ``PackedRows``'; a branch's position
            ids continue the prefix's (P-1, P, ...), as in the sequence it stands for.
        allowed_RLL: True where query ``i`` may attend key ``j``: the same unit (a prefix and its
            branches), ``j <= i``, and ``j`` in the prefix or in ``i``'s own branch.
        order: The sequences' indices in layout order (row-major, branch after branch).
    """

    input_ids_RL: Tensor
    position_ids_RL: Tensor
    completion_mask_RL: Tensor
    allowed_RLL: Tensor
    order: list[int]


def _prompt_units(sequences: list[Sequence], unit_tokens: int) -> list[list[int]]:
    """Sequence indices grouped by prompt (first appearance order), each group cut into units whose
    prefix plus branches fit in ``unit_tokens`` (a unit holds at least one branch)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, _) in enumerate(sequences):
        groups.setdefault(tuple(prompt), []).append(i)
    units = []
    for prompt, members in groups.items():
        unit, tokens = [], len(prompt) - 1
        for i in members:
            branch = 1 + len(sequences[i][1])
            if unit and tokens + branch > unit_tokens:
                units.append(unit)
                unit, tokens = [], len(prompt) - 1
            unit.append(i)
            tokens += branch
        units.append(unit)
    return units


def _unit_layout(sequences: list[Sequence], unit: list[int]) -> tuple[list[int], list[int], list[bool], list[int]]:
    """(ids, position ids, completion mask, branch number: -1 in the prefix) of one unit."""
    prompt = sequences[unit[0]][0]
    prefix = len(prompt) - 1
    ids, positions, mask, branch = list(prompt[:-1]), list(range(prefix)), [False] * prefix, [-1] * prefix
    for b, i in enumerate(unit):
        completion = sequences[i][1]
        ids += [prompt[-1], *completion]
        positions += range(prefix, len(prompt) + len(completion))
        mask += [True] * len(completion) + [False]  # position k predicts completion token k
        branch += [b] * (1 + len(completion))
    return ids, positions, mask, branch


def pack_shared_prompts(sequences: list[Sequence], unit_tokens: int, pad_id: int) -> SharedPromptRows:
    """Lays sequences out so that those with the same prompt compute it once (``SharedPromptRows``):
    GRPO samples several completions per prompt, and a prompt is often longer than its completions
    (the quickstart's: ~20 prompt tokens, ~4 completion tokens), so most of a packed batch's tokens
    repeat a prompt. Units (``_prompt_units``, at most ``max(unit_tokens, longest sequence)``
    tokens) go into rows as long as the longest unit, first fit, longest first, as ``pack_rows``
    does with sequences: attention and its mask cost rows x L x L, never one row of everything.
    The rows' unused tails attend only to themselves.

    Every completion token's log-prob is the same function of the weights as in its own sequence
    (same tokens before it, same positions), so results equal ``pack``'s up to float rounding and
    gradients add up through the shared prefix as through the separate copies.

    Raises:
        ValueError: If there are no sequences or a prompt is empty.
    """
    _check(sequences)
    unit_tokens = max(unit_tokens, *(len(p) + len(c) for p, c in sequences))
    units = [_unit_layout(sequences, unit) + (unit,) for unit in _prompt_units(sequences, unit_tokens)]
    lengths = [len(u[0]) for u in units]
    rows = first_fit_rows(lengths, max(lengths))
    width = max(sum(len(units[u][0]) for u in row) for row in rows)
    causal_LL = torch.ones(width, width, dtype=torch.bool).tril()
    ids, positions, masks, allowed, order = [], [], [], [], []
    for row in rows:
        row_ids, row_positions, row_mask, unit_of, branch_of = [], [], [], [], []
        for u in row:
            unit_ids, unit_positions, unit_mask, unit_branch, members = units[u]
            row_ids += unit_ids
            row_positions += unit_positions
            row_mask += unit_mask
            unit_of += [u] * len(unit_ids)
            branch_of += unit_branch
            order += members
        tail = width - len(row_ids)
        ids.append(row_ids + [pad_id] * tail)
        positions.append(row_positions + list(range(tail)))
        masks.append(row_mask + [False] * tail)
        unit_L, branch_L = torch.tensor(unit_of + [-1] * tail), torch.tensor(branch_of + [-1] * tail)
        allowed.append((unit_L[:, None] == unit_L[None, :]) & causal_LL
                       & ((branch_L[None, :] == -1) | (branch_L[None, :] == branch_L[:, None])))
    return SharedPromptRows(torch.tensor(ids), torch.tensor(positions), torch.tensor(masks), torch.stack(allowed),
                            order)
