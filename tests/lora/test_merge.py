"""graft.lora.merge: merged weights equal base + LoRA, are rounded once, and never touch the base.

Suffixes: _BTV logits [batch, tokens, vocab].
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from graft.lora import merge
from graft.lora.attach import ADAPTER_NAME, lora_modules
from graft.lora.merge import _ROWS_PER_CHUNK, iter_merged_weights, merge_weight
from graft.models.loading import load_model
from tests.helpers import trained_like_peft_model

ARCHS = ["qwen2", "llama"]
FP32_EPS = 2.0**-24  # unit roundoff of fp32 (round to nearest)


def _plain_model(config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    """A plain HF model holding exactly `state_dict` (strict: every key present, none extra)."""
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.double()


def _exact_merge(weight, lora_A, lora_B, scaling) -> torch.Tensor:
    """`W + s·B@A` in float64: exact up to 2^-53 relative for these inputs, the reference value."""
    return weight.double() + scaling * (lora_B.double() @ lora_A.double())


def _fp32_error_bound(weight, lora_A, lora_B, scaling) -> torch.Tensor:
    """Forward error bound of forming `s·A`, then `B @ sA`, then `W +` that, in fp32, per element.

    Standard bound: a rank-r dot product in fp32 errs by at most ~r·u·Σ|b||a|; scaling A and the
    final add each add one more rounding u. (r + 2)·u·(|W| + s·|B|@|A|) covers all of it.
    """
    rank = lora_A.shape[0]
    magnitude = weight.double().abs() + abs(scaling) * lora_B.double().abs() @ lora_A.double().abs()
    return (rank + 2) * FP32_EPS * magnitude


def _half_bf16_ulp(exact: torch.Tensor) -> torch.Tensor:
    """Half the bf16 spacing at `exact`: round-to-nearest to bf16 errs by at most this much.

    bf16 keeps 8 significant bits; for |x| in [2^(e-1), 2^e) (frexp's exponent e) the spacing is
    2^(e-8), half of it 2^(e-9).
    """
    _, exponent = torch.frexp(exact)
    return torch.ldexp(torch.ones_like(exact), exponent - 9)


def _module_inputs(module):
    return (module.get_base_layer().weight.detach(), module.lora_A[ADAPTER_NAME].weight.detach(),
            module.lora_B[ADAPTER_NAME].weight.detach(), module.scaling[ADAPTER_NAME])


# --- merge_weight --------------------------------------------------------------------------------

@pytest.mark.parametrize("out_features", [1, 255, 256, 300, 513])
def test_merge_weight_equals_fp64_reference_within_fp32_rounding(out_features):
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 96, generator=generator)
    lora_A = torch.randn(4, 96, generator=generator)
    lora_B = torch.randn(out_features, 4, generator=generator)
    inputs = (weight, lora_A, lora_B, 0.75)

    merged = merge_weight(*inputs)

    assert merged.shape == (out_features, 96) and merged.dtype == torch.float32
    error = (merged.double() - _exact_merge(*inputs)).abs()
    assert (error <= _fp32_error_bound(*inputs)).all(), error.max()
    # Every chunk is merged, including the last partial one (rows past a multiple of 256).
    assert not torch.equal(merged[-1], weight[-1])


def test_merge_weight_chunks_agree_with_one_unchunked_fp32_merge():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(_ROWS_PER_CHUNK * 2 + 1, 64, generator=generator)
    lora_A, lora_B = torch.randn(8, 64, generator=generator), torch.randn(weight.shape[0], 8, generator=generator)
    unchunked = weight + lora_B @ (lora_A * 2.0)
    torch.testing.assert_close(merge_weight(weight, lora_A, lora_B, 2.0), unchunked, rtol=1e-6, atol=1e-6)


def test_merge_weight_does_not_modify_its_inputs_and_returns_a_new_tensor():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 48, generator=generator)
    lora_A, lora_B = torch.randn(4, 48, generator=generator), torch.randn(300, 4, generator=generator)
    before = [t.clone() for t in (weight, lora_A, lora_B)]

    merged = merge_weight(weight, lora_A, lora_B, 2.0, dtype=torch.float32)

    for original, tensor in zip(before, (weight, lora_A, lora_B)):
        assert torch.equal(original, tensor)
    assert merged.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    merged.zero_()
    assert torch.equal(weight, before[0])


def test_merge_weight_zero_lora_returns_the_weight_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(513, 32, generator=generator).to(torch.bfloat16)
    merged = merge_weight(weight, torch.randn(4, 32, generator=generator), torch.zeros(513, 4), 2.0)
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, weight)


@pytest.mark.parametrize(("weight_dtype", "dtype", "expected"), [
    (torch.float32, None, torch.float32),
    (torch.bfloat16, None, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16, torch.float16),
    (torch.bfloat16, torch.float32, torch.float32),
])
def test_merge_weight_output_dtype(weight_dtype, dtype, expected):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 32, generator=generator).to(weight_dtype)
    lora_A, lora_B = torch.randn(4, 32, generator=generator), torch.randn(300, 4, generator=generator) * 0.1
    merged = merge_weight(weight, lora_A, lora_B, 2.0, dtype=dtype)
    assert merged.dtype == expected
    # The value is the fp32 merge rounded once to `expected`.
    assert torch.equal(merged, merge_weight(weight, lora_A, lora_B, 2.0, dtype=torch.float32).to(expected))


# --- devices -------------------------------------------------------------------------------------

def _random_inputs(out_features: int = 700, in_features: int = 48, rank: int = 8):
    generator = torch.Generator().manual_seed(out_features)
    return (torch.randn(out_features, in_features, generator=generator),
            torch.randn(rank, in_features, generator=generator) * 0.1,
            torch.randn(out_features, rank, generator=generator) * 0.1, 2.0)


def test_merge_weight_runs_on_the_weights_device_with_the_lora_factors_moved_there():
    weight, lora_A, lora_B, scaling = _random_inputs()
    merged = merge_weight(weight.to("meta"), lora_A, lora_B, scaling, dtype=torch.bfloat16)
    assert merged.device.type == "meta" and merged.shape == weight.shape and merged.dtype == torch.bfloat16


def test_merge_weight_refuses_lora_factors_that_hold_no_data_rather_than_mixing_devices():
    weight, lora_A, lora_B, scaling = _random_inputs()
    with pytest.raises(NotImplementedError, match="meta"):
        merge_weight(weight, lora_A.to("meta"), lora_B, scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_accelerator_merge_is_the_exact_sum_rounded_once_in_every_chunk(monkeypatch, dtype):
    """The GPU path's arithmetic, run here on CPU tensors: fp64 leaves nothing but the final rounding."""
    inputs = _random_inputs()
    monkeypatch.setattr(merge, "_DEVICE_CHUNK_BYTES", 8 * 48 * 100)  # 100-row chunks, the last one partial
    merged = merge._merge_on_device(*inputs, dtype)
    assert merged.dtype == dtype and torch.equal(merged, _exact_merge(*inputs).to(dtype))


def _cuda_inputs(inputs):
    weight, lora_A, lora_B, scaling = inputs
    return weight.cuda(), lora_A.cuda(), lora_B.cuda(), scaling


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_cuda_merge_is_the_exact_sum_rounded_once_whatever_the_tf32_switches(dtype, weight_dtype):
    weight, lora_A, lora_B, scaling = _random_inputs(out_features=4096, in_features=1024, rank=16)
    inputs = (weight.to(weight_dtype), lora_A, lora_B, scaling)
    expected = _exact_merge(*inputs).to(dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            merged = merge_weight(*_cuda_inputs(inputs), dtype=dtype)
            assert merged.device.type == "cuda" and merged.dtype == dtype
            assert torch.equal(merged.cpu(), expected), f"allow_tf32={tf32}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
def test_merged_weights_of_a_cuda_peft_model_stay_on_the_gpu_and_equal_the_exact_merge(tiny_model_dirs):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    on_cpu = dict(iter_merged_weights(model, torch.bfloat16))
    exact = {f"{name.removeprefix('base_model.model.')}.weight": _exact_merge(*_module_inputs(module))
             for name, module in lora_modules(model)}
    model.cuda()
    on_cuda = list(iter_merged_weights(model, torch.bfloat16))
    assert [name for name, _ in on_cuda] == list(on_cpu)
    for name, tensor in on_cuda:
        assert tensor.device.type == "cuda" and tensor.dtype == torch.bfloat16, name
        want = exact[name].to(torch.bfloat16) if name in exact else on_cpu[name]  # no LoRA: the weight as it is
        assert torch.equal(tensor.cpu(), want), name
    assert exact.keys() <= on_cpu.keys() and exact


# --- names ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
@pytest.mark.parametrize("arch", ARCHS)
def test_merged_names_are_the_plain_hf_state_dict_keys(tiny_model_dirs, arch, targets):
    plain = load_model(tiny_model_dirs[arch]).state_dict()
    model = trained_like_peft_model(tiny_model_dirs[arch], target_modules=targets)

    merged = list(iter_merged_weights(model))
    names = [name for name, _ in merged]

    assert len(names) == len(set(names))
    assert sorted(names) == sorted(plain)
    assert not [n for n in names if "base_model" in n or "base_layer" in n or "lora_" in n]
    merged = dict(merged)
    for name, tensor in plain.items():
        assert merged[name].shape == tensor.shape and merged[name].dtype == tensor.dtype, name
    adapted = {f"{name}.weight" for name, _ in lora_modules(model.get_base_model())}
    assert adapted  # the adapted weights differ from the base; everything else is the base, as is
    for name, tensor in plain.items():
        assert torch.equal(merged[name], tensor) == (name not in adapted), name
    if arch == "qwen2":  # q/k/v carry biases; they pass through with the base_layer prefix removed
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"} <= set(names)
    if targets != "all-linear":
        assert {n.rsplit(".", 2)[-2] for n in adapted} == {"q_proj", "v_proj"}


# --- merged model vs base + adapter --------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_merged_logits_match_base_plus_adapter(tiny_model_dirs, arch, input_ids):
    model = trained_like_peft_model(tiny_model_dirs[arch])
    reference_BTV = _logits(model, input_ids)
    with model.disable_adapter():
        base_BTV = _logits(model, input_ids)

    merged = _plain_model(model.get_base_model().config, dict(iter_merged_weights(model)), torch.float32)
    merged_BTV = _logits(merged, input_ids)

    # Measured 3.0e-7 for both archs (logits of magnitude ~0.7); the adapter moves them by ~0.5,
    # so a merge that drops, double-counts or mis-scales LoRA fails by three orders of magnitude.
    assert (reference_BTV - base_BTV).abs().max() > 0.1
    assert (merged_BTV - reference_BTV).abs().max() <= 1e-4


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_merge_rounds_once_to_nearest(tiny_model_dirs, arch, base_dtype):
    """Every bf16 merged element is within half a bf16 ulp of the exact W + s·B@A.

    Rounding the exact value to nearest bf16 errs by at most half an ulp; graft forms the sum in
    fp32 first, so the only other error is the fp32 one (`_fp32_error_bound`: (r + 2)·2^-24
    relative, ~1e-4 of a bf16 ulp). Two roundings (delta rounded to bf16, then a bf16 add, as PEFT
    does) add up to half a bf16 ulp *of the delta*, far beyond this bound where W and the delta
    nearly cancel.
    base_dtype float32 is the export path (fp32 base, bf16 output); bfloat16 the trainer's.
    """
    model = trained_like_peft_model(tiny_model_dirs[arch]).to(base_dtype)
    merged = dict(iter_merged_weights(model, torch.bfloat16))
    modules = list(lora_modules(model.get_base_model()))
    assert len(modules) == 14
    for name, module in modules:
        inputs = _module_inputs(module)
        exact = _exact_merge(*inputs)
        error = (merged[f"{name}.weight"].double() - exact).abs()
        assert merged[f"{name}.weight"].dtype == torch.bfloat16
        assert (error <= _half_bf16_ulp(exact) + _fp32_error_bound(*inputs)).all(), name
        # Nearly always the correctly rounded value itself (measured: all but <0.03% of elements;
        # those lie within fp32 rounding of a bf16 midpoint, where the fp32 sum may round the other way).
        assert (merged[f"{name}.weight"] == exact.to(torch.bfloat16)).double().mean() > 0.999, name


@pytest.mark.parametrize("arch", ARCHS)
def test_peft_inplace_bf16_merge_is_not_better_than_graft(tiny_model_dirs, arch, input_ids):
    """On the same bf16 model, PEFT's merge_adapter rounds twice; graft's one rounding is never worse."""
    model_bf16 = trained_like_peft_model(tiny_model_dirs[arch]).to(torch.bfloat16)
    peft_merged = copy.deepcopy(model_bf16)
    peft_merged.merge_adapter()
    peft_weights = {name: module.get_base_layer().weight
                    for name, module in lora_modules(peft_merged.get_base_model())}
    graft_weights = dict(iter_merged_weights(model_bf16))

    peft_outside_bound = graft_total = peft_total = 0.0
    for name, module in lora_modules(model_bf16.get_base_model()):
        inputs = _module_inputs(module)
        exact = _exact_merge(*inputs)
        slack = _fp32_error_bound(*inputs)
        graft_error = (graft_weights[f"{name}.weight"].double() - exact).abs()
        peft_error = (peft_weights[name].double() - exact).abs()
        # Element by element: graft's value is (up to fp32 slack) the nearest bf16, so no bf16 value
        # PEFT produces can be closer to the exact merge.
        assert (graft_error <= peft_error + slack).all(), name
        peft_outside_bound += (peft_error > _half_bf16_ulp(exact) + slack).sum().item()
        graft_total += graft_error.sum().item()
        peft_total += peft_error.sum().item()
    # Measured: ~25k of the ~98k merged elements of PEFT's merge are outside the one-rounding bound
    # (by up to ~400x, where W and the delta cancel), and its summed |error| is ~25% larger.
    assert peft_outside_bound > 1000
    assert graft_total < peft_total

    # In the logits (fp32 base + adapter as reference) the difference is small but in the same
    # direction: RMS error graft 1.14e-3 vs PEFT 1.29e-3 (qwen2), 1.01e-3 vs 1.06e-3 (llama).
    reference_BTV = _logits(trained_like_peft_model(tiny_model_dirs[arch]), input_ids)
    graft_model = _plain_model(model_bf16.get_base_model().config, graft_weights, torch.bfloat16)
    graft_rms = (_logits(graft_model, input_ids) - reference_BTV).pow(2).mean().sqrt()
    peft_rms = (_logits(peft_merged, input_ids) - reference_BTV).pow(2).mean().sqrt()
    assert graft_rms <= peft_rms


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_merged_logits_are_as_close_as_bf16_allows(tiny_model_dirs, arch, input_ids):
    """bf16 merged model vs the fp32 base + adapter: no worse than casting that model to bf16.

    The unavoidable bf16 error is what casting the fp32 base + adapter model to bf16 gives: every
    weight rounded once, bf16 activations. The merged model has the same (one rounding per weight,
    bf16 forward), so its error must be of the same size. Measured max |Δ| (logits ~0.7):
    qwen2 4.6e-3 merged vs 5.4e-3 cast, llama 4.4e-3 vs 5.0e-3 (ratio 0.87-0.89); RMS 1.0e-3 vs
    1.3e-3 and 0.95e-3 vs 1.03e-3. The bound 1.25 × cast leaves room for where individual rounding
    errors happen to land; losing the adapter (Δ ~0.5) or rounding the merge in bf16 more than
    once where weights cancel would not stay inside it.
    """
    model = trained_like_peft_model(tiny_model_dirs[arch])
    reference_BTV = _logits(model, input_ids)
    cast_BTV = _logits(copy.deepcopy(model).to(torch.bfloat16), input_ids)
    merged = _plain_model(model.get_base_model().config, dict(iter_merged_weights(model, torch.bfloat16)),
                          torch.bfloat16)
    merged_BTV = _logits(merged, input_ids)

    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    cast_error, merged_error = (cast_BTV - reference_BTV).abs(), (merged_BTV - reference_BTV).abs()
    assert 0 < merged_error.max() <= 1.25 * cast_error.max()
    assert merged_error.pow(2).mean().sqrt() <= 1.25 * cast_error.pow(2).mean().sqrt()


# --- the base is only read -----------------------------------------------------------------------

def test_1000_merges_leave_the_base_bit_identical(tiny_model_dirs):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    # One thread: these 64-wide matrices gain nothing from two, and with two OpenMP threads on the
    # 2-core test machine single runs stalled for up to 12 s per 100 merges (1 s at one thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = {name: tensor.clone() for name, tensor in iter_merged_weights(model)}
        for _ in range(998):
            for _ in iter_merged_weights(model):
                pass
        last = dict(iter_merged_weights(model))
    finally:
        torch.set_num_threads(threads)

    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name  # base and LoRA weights: not one bit moved
    assert first.keys() == last.keys()
    for name, tensor in first.items():
        assert torch.equal(last[name], tensor), name
