"""graft.rl.packing: packed, left-padded and right-padded layouts give the same completion log-probs.

A one-off misalignment elsewhere produced importance ratios of ~451,728 instead of ~1.0; these
tests compare every layout, token by token, with a direct per-sequence computation.
Shape suffixes: see graft/__init__.py.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from graft.rl.logprobs import token_logprobs_and_entropy
from graft.rl.packing import (
    completion_rows,
    completion_rows_mask,
    first_fit_rows,
    next_token_targets,
    pack,
    pack_rows,
    pack_shared_prompts,
    pad,
)
from tests.helpers import (
    block_diagonal_mask,
    padded_completion_logprobs,
    position_ids_from_mask,
    unpack_completion_logprobs,
)


def token_logprobs(logits_xV, tokens_x):
    return token_logprobs_and_entropy(logits_xV, tokens_x, with_entropy=False)[0]


VOCAB = 50


class FakeLM:
    """Deterministic stand-in for a causal LM: logits depend on (token id, position id) only,
    so wrong position ids or a one-off target show up as different log-probs."""

    def __init__(self, seed: int = 0, dim: int = 16, max_pos: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.tok_VH = torch.randn(VOCAB, dim, generator=g, dtype=torch.float64)
        self.pos_TH = torch.randn(max_pos, dim, generator=g, dtype=torch.float64)
        self.out_HV = torch.randn(dim, VOCAB, generator=g, dtype=torch.float64)

    def __call__(self, input_ids_xT, position_ids_xT):
        return (self.tok_VH[input_ids_xT] + self.pos_TH[position_ids_xT]) @ self.out_HV


def _random_sequences(g: torch.Generator):
    sequences = []
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        prompt_len = int(torch.randint(1, 9, (1,), generator=g))
        # Completion length 1 about a third of the time.
        completion_len = 1 if torch.rand(1, generator=g) < 0.33 else int(torch.randint(1, 9, (1,), generator=g))
        sequences.append((torch.randint(1, VOCAB, (prompt_len,), generator=g).tolist(),
                          torch.randint(1, VOCAB, (completion_len,), generator=g).tolist()))
    return sequences


def _direct(model, sequences):
    """Unpadded, one sequence at a time, indices written out: completion token i is scored by
    the logits at position P - 1 + i."""
    out = []
    for prompt, completion in sequences:
        ids_T = torch.tensor(prompt + completion)
        logprobs_TV = model(ids_T, torch.arange(len(ids_T))).float().log_softmax(-1)
        out.append(torch.stack([logprobs_TV[len(prompt) - 1 + i, tok] for i, tok in enumerate(completion)]))
    return out


def _packed(model, sequences):
    packed = pack(sequences)
    logits_NV = model(packed.input_ids_N, packed.position_ids_N)
    return unpack_completion_logprobs(token_logprobs(logits_NV, next_token_targets(packed.input_ids_N)), packed)


def _padded(model, sequences, side, pad_id):
    input_ids_BT, attention_mask_BT, completion_mask_BT = pad(sequences, side, pad_id)
    logits_BTV = model(input_ids_BT, position_ids_from_mask(attention_mask_BT))
    logprobs_BT = token_logprobs(logits_BTV, next_token_targets(input_ids_BT))
    return padded_completion_logprobs(logprobs_BT, completion_mask_BT)


def _assert_same(got, expected):
    assert [x.shape for x in got] == [x.shape for x in expected]
    for g_C, e_C in zip(got, expected):
        torch.testing.assert_close(g_C, e_C, atol=1e-6, rtol=0)
        # The quantity that went wrong before: importance ratios must be 1.
        torch.testing.assert_close(torch.exp(g_C - e_C), torch.ones_like(g_C), atol=1e-5, rtol=0)


def test_all_layouts_match_direct_computation():
    model = FakeLM()
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        sequences = _random_sequences(g)
        pad_id = int(torch.randint(0, VOCAB, (1,), generator=g))
        expected = _direct(model, sequences)
        _assert_same(_packed(model, sequences), expected)
        _assert_same(_padded(model, sequences, "left", pad_id), expected)
        _assert_same(_padded(model, sequences, "right", pad_id), expected)


def _rows_of(model, sequences, layout: str, pad_id: int):
    """``completion_rows`` of a packed row or a padded batch, back to a list of sequences."""
    order = list(range(len(sequences)))
    if layout == "packed":
        packed = pack(sequences)
        ids_xT, positions_xT = packed.input_ids_N[None], packed.position_ids_N[None]
        mask_xT = packed.completion_mask_N[None]
    elif layout == "packed rows":
        rows = pack_rows(sequences, max(len(p) + len(c) for p, c in sequences), pad_id)
        ids_xT, positions_xT, mask_xT = rows.input_ids_RL, rows.position_ids_RL, rows.completion_mask_RL
        order = rows.order
    else:
        ids_xT, attention_xT, mask_xT = pad(sequences, layout, pad_id)
        positions_xT = position_ids_from_mask(attention_xT)
    lens = [len(sequences[i][1]) for i in order]
    rows_BC = completion_rows(token_logprobs(model(ids_xT, positions_xT), next_token_targets(ids_xT)), mask_xT, lens)
    mask_BC = completion_rows_mask(lens)
    assert rows_BC.shape == (len(sequences), max(lens)) and (rows_BC[~mask_BC] == 0).all()
    by_sequence = dict(zip(order, (row_C[:n] for row_C, n in zip(rows_BC, lens))))
    return [by_sequence[i] for i in range(len(sequences))]


def test_completion_rows_match_direct_computation_in_every_layout():
    """The one map back to sequences (used by the update for packed and padded micro-batches)."""
    model = FakeLM()
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        sequences = _random_sequences(g)
        pad_id = int(torch.randint(0, VOCAB, (1,), generator=g))
        expected = _direct(model, sequences)
        for layout in ("packed", "packed rows", "left", "right"):
            _assert_same(_rows_of(model, sequences, layout, pad_id), expected)


def test_completion_rows_refuse_lengths_that_do_not_match_the_mask():
    packed = pack([([1, 2], [3, 4]), ([5], [6])])
    values_1N = torch.zeros(1, len(packed.input_ids_N))
    with pytest.raises(AssertionError, match="completion lengths"):
        completion_rows(values_1N, packed.completion_mask_N[None], [2, 2])
    with pytest.raises(AssertionError, match="layout"):
        completion_rows(values_1N[:, 1:], packed.completion_mask_N[None], [2, 1])


def test_the_check_catches_misalignment_and_wrong_positions():
    model = FakeLM()
    sequences = [([3, 4, 5], [6, 7]), ([8], [9]), ([10, 11], [12, 13, 14])]
    expected = torch.cat(_direct(model, sequences))
    packed = pack(sequences)
    targets_N = next_token_targets(packed.input_ids_N)
    logprobs_N = token_logprobs(model(packed.input_ids_N, packed.position_ids_N), targets_N)
    # One-off: scoring each completion token with the logits at its own position.
    shifted = token_logprobs(model(packed.input_ids_N, packed.position_ids_N), packed.input_ids_N)
    assert not torch.allclose(shifted[packed.completion_mask_N], expected, atol=1e-3)
    # Positions that do not restart per sequence.
    no_restart_N = token_logprobs(model(packed.input_ids_N, torch.arange(len(targets_N))), targets_N)
    assert not torch.allclose(no_restart_N[packed.completion_mask_N], expected, atol=1e-3)
    # Left padding with HF's default arange positions.
    input_ids_BT, _, completion_mask_BT = pad(sequences, "left", 0)
    arange_BT = torch.arange(input_ids_BT.shape[1]).expand_as(input_ids_BT)
    left_BT = token_logprobs(model(input_ids_BT, arange_BT), next_token_targets(input_ids_BT))
    assert not torch.allclose(left_BT[completion_mask_BT], expected, atol=1e-3)
    torch.testing.assert_close(logprobs_N[packed.completion_mask_N], expected, atol=1e-6, rtol=0)


def test_pack_layout_by_hand():
    packed = pack([([1, 2], [3]), ([4], [5, 6]), ([7, 8], [])])
    assert packed.input_ids_N.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert packed.position_ids_N.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert packed.completion_mask_N.tolist() == [False, True, False, True, True, False, False, False]
    assert packed.seq_lens == [3, 3, 2] and packed.completion_lens == [1, 2, 0]
    values = unpack_completion_logprobs(torch.arange(8.0)[None], packed)
    assert [v.tolist() for v in values] == [[1.0], [3.0, 4.0], []]


def test_pad_layout_by_hand():
    sequences = [([1, 2], [3]), ([4], [5, 6, 7])]
    ids_BT, attn_BT, comp_BT = pad(sequences, "left", 0)
    assert ids_BT.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert attn_BT.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert comp_BT.tolist() == [[False, False, True, False], [True, True, True, False]]
    assert position_ids_from_mask(attn_BT).tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    ids_BT, attn_BT, comp_BT = pad(sequences, "right", -1)
    assert ids_BT.tolist() == [[1, 2, 3, -1], [4, 5, 6, 7]]
    assert attn_BT.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert comp_BT.tolist() == [[False, True, False, False], [True, True, True, False]]


def test_user_errors():
    with pytest.raises(ValueError, match="empty prompt"):
        pack([([], [1, 2])])
    with pytest.raises(ValueError, match="no sequences"):
        pad([], "left", 0)
    with pytest.raises(ValueError, match="'middle'"):
        pad([([1], [2])], "middle", 0)


def test_block_diagonal_mask_by_hand():
    mask = block_diagonal_mask([2, 1, 2])
    assert mask.shape == (1, 1, 5, 5)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [0, 0, 1, 0, 0],
                       [0, 0, 0, 1, 0],
                       [0, 0, 0, 1, 1]]
    assert mask.min() == torch.finfo(torch.float32).min


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_real_tiny_model_layouts_agree(tiny_model_dirs, arch):
    """Left/right padding, unpadded, and packed with a block-diagonal 4-D mask agree (<= 1e-5).

    Packed with ``position_ids`` alone does NOT agree on transformers 5.19 (sdpa or eager on
    CPU): tokens attend to the sequences packed before them. Packing needs the block-diagonal mask
    (or varlen flash attention, not available on CPU).
    """
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch]).eval()
    g = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(3, 500, (p,), generator=g).tolist(), torch.randint(3, 500, (c,), generator=g).tolist())
                 for p, c in [(3, 4), (5, 1), (2, 6), (7, 2)]]

    def run(input_ids, **kwargs):
        logits = model(input_ids=input_ids, **kwargs).logits
        return token_logprobs(logits, next_token_targets(input_ids))

    with torch.no_grad():
        expected = []
        for prompt, completion in sequences:
            logprobs_1L = run(torch.tensor([prompt + completion]))
            expected.append(logprobs_1L[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)])
        for side in ("left", "right"):
            ids_BT, attn_BT, comp_BT = pad(sequences, side, pad_id=0)
            logprobs_BT = run(ids_BT, attention_mask=attn_BT, position_ids=position_ids_from_mask(attn_BT))
            for got_C, exp_C in zip(padded_completion_logprobs(logprobs_BT, comp_BT), expected, strict=True):
                torch.testing.assert_close(got_C, exp_C, atol=1e-5, rtol=0)
        packed = pack(sequences)
        ids_1N, pos_1N = packed.input_ids_N[None], packed.position_ids_N[None]
        masked = unpack_completion_logprobs(
            run(ids_1N, position_ids=pos_1N, attention_mask=block_diagonal_mask(packed.seq_lens)), packed)
        for got_C, exp_C in zip(masked, expected, strict=True):
            torch.testing.assert_close(got_C, exp_C, atol=1e-5, rtol=0)
        # Documents the trap: position ids alone let later sequences see earlier ones.
        leaky = unpack_completion_logprobs(run(ids_1N, position_ids=pos_1N), packed)
        torch.testing.assert_close(leaky[0], expected[0], atol=1e-5, rtol=0)  # the first sees nothing extra
        assert max((got - exp).abs().max().item() for got, exp in zip(leaky[1:], expected[1:])) > 1e-3


def test_pack_rows_by_hand():
    """Rows as long as the longest sequence, filled longest first; tails restart their positions."""
    sequences = [([1, 2], [3]), ([4], [5, 6, 7, 8]), ([9], [10]), ([11], [12])]  # lengths 3, 5, 2, 2
    rows = pack_rows(sequences, row_tokens=5, pad_id=0)
    assert rows.order == [1, 0, 2, 3]  # row 0: sequence 1; row 1: sequences 0 and 2; row 2: sequence 3
    assert rows.input_ids_RL.tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 9, 10], [11, 12, 0, 0, 0]]
    assert rows.position_ids_RL.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert rows.completion_mask_RL.int().tolist() == [[1, 1, 1, 1, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert first_fit_rows([3, 5, 2, 2], 5) == [[1], [0, 2], [3]]
    assert first_fit_rows([3, 5, 2, 2], 1) == [[1], [0, 2], [3]]  # never shorter than the longest


def test_pack_shared_prompts_by_hand():
    """One prompt's rows share its tokens but the last; each branch repeats the last prompt token
    (whose logits score the first completion token), continues its positions and sees the prefix and
    itself only; a prompt seen once is a unit of its own; tails attend to themselves."""
    sequences = [([1, 2, 3], [4, 5]), ([7, 8], [9]), ([1, 2, 3], [6]), ([1, 2, 3], [10, 11, 12])]
    rows = pack_shared_prompts(sequences, unit_tokens=1024, pad_id=0)
    assert rows.order == [0, 2, 3, 1]
    assert rows.input_ids_RL.tolist() == [[1, 2, 3, 4, 5, 3, 6, 3, 10, 11, 12], [7, 8, 9] + [0] * 8]
    assert rows.position_ids_RL.tolist() == [[0, 1, 2, 3, 4, 2, 3, 2, 3, 4, 5], [0, 1, 2, *range(8)]]
    assert rows.completion_mask_RL.int().tolist() == [[0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0], [0, 1] + [0] * 9]
    assert rows.allowed_RLL[0, 6].int().tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]  # prefix + own branch
    assert rows.allowed_RLL[0, 10].int().tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert rows.allowed_RLL[1, 4].int().tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]  # the tail
    # A unit budget of 7 tokens: the prompt's three rows go into two units, each with the prefix.
    split = pack_shared_prompts(sequences, unit_tokens=7, pad_id=0)
    assert split.order == [0, 2, 3, 1]
    assert split.input_ids_RL.tolist() == [[1, 2, 3, 4, 5, 3, 6], [1, 2, 3, 10, 11, 12, 0], [7, 8, 9, 0, 0, 0, 0]]
    assert split.position_ids_RL.tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 0, 1, 2, 3]]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shared_prompt_rows_give_each_sequences_own_logprobs(tiny_model_dirs, arch):
    """On a real model (sdpa attention, boolean 4-D mask), every completion token's log-prob in the
    shared layout equals its own sequence's (<= 1e-5), also with units split by the budget."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (p,), generator=g).tolist() for p in (6, 1, 9)]
    sequences = [(prompts[i], torch.randint(3, 500, (c,), generator=g).tolist())
                 for i, c in [(0, 3), (1, 2), (0, 1), (2, 4), (0, 5), (2, 2), (1, 0)]]
    with torch.no_grad():
        expected = []
        for prompt, completion in sequences:
            ids_1L = torch.tensor([prompt + completion])
            logprobs_1L = token_logprobs(model(input_ids=ids_1L).logits, next_token_targets(ids_1L))
            expected.append(logprobs_1L[0, len(prompt) - 1: len(prompt) - 1 + len(completion)])
        for unit_tokens in (1024, 12):
            rows = pack_shared_prompts(sequences, unit_tokens, pad_id=0)
            logits = model(input_ids=rows.input_ids_RL, position_ids=rows.position_ids_RL,
                           attention_mask=rows.allowed_RLL[:, None]).logits
            got_BC = completion_rows(token_logprobs(logits, next_token_targets(rows.input_ids_RL)),
                                     rows.completion_mask_RL, [len(sequences[i][1]) for i in rows.order])
            for b, i in enumerate(rows.order):
                torch.testing.assert_close(got_BC[b, :len(sequences[i][1])], expected[i], atol=1e-5, rtol=0)
