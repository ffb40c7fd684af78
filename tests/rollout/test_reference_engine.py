"""graft.rollout.reference: the in-process engine against plain transformers/PEFT, on tiny fp32 models.

Suffixes: _V vocabulary.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from graft.lora.adapter_io import ADAPTER_WEIGHTS, load_adapter, save_adapter
from graft.lora.export import export_merged
from graft.models.loading import load_model, load_tokenizer
from graft.models.tiny import build_tiny_model
from graft.rl.logprobs import sequence_logprobs
from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    BadRequestError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    UnknownAdapterError,
)
from graft.rollout.reference import ReferenceEngine, resolve_device, sample_token
from tests.helpers import trained_like_peft_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
TOL = 1e-5


@pytest.fixture(scope="module")
def dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """The base (qwen2, seed 0), a same-shape model (seed 1), a wider one, adapters A and B on the
    base, an adapter for the wider model, and base + A exported merged."""
    root = tmp_path_factory.mktemp("reference")
    base = tiny_model_dirs["qwen2"]
    out = {"base": base,
           "seed1": build_tiny_model(root / "seed1", hidden=64, layers=2, seed=1),
           "wide": build_tiny_model(root / "wide", hidden=96, layers=2, seed=0)}
    out["A"] = save_adapter(trained_like_peft_model(base, seed=1), root / "A")
    out["B"] = save_adapter(trained_like_peft_model(base, seed=2), root / "B")
    out["wide_adapter"] = save_adapter(trained_like_peft_model(out["wide"], seed=1), root / "wide_adapter")
    export_merged(base, out["A"], root / "merged_A")
    out["merged_A"] = root / "merged_A"
    return out


@pytest.fixture(scope="module")
def prompt(tiny_model_dirs) -> tuple[int, ...]:
    return tuple(load_tokenizer(tiny_model_dirs["qwen2"]).encode("What is 12 + 7?"))


def run(coro):
    return asyncio.run(coro)


def generate(engine, params=GREEDY, prompt=None, adapter=None):
    return run(engine.generate([GenerateRequest(prompt, params)], adapter))[0]


def hf_greedy(model, prompt, max_new_tokens=16) -> tuple[list[int], list[float]]:
    """transformers' own greedy decoding and the log-softmax of the raw logits it saw."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(logits_1V[0].float(), -1)[t]) for logits_1V, t in zip(out.logits, tokens)]
    return tokens, logprobs


def close(a, b, tol=TOL) -> bool:
    return len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= tol


def test_is_a_rollout_engine_and_reports_health(dirs):
    engine = ReferenceEngine(dirs["base"])
    assert isinstance(engine, RolloutEngine)
    run(engine.load_adapter("policy-v1", str(dirs["A"])))
    health = run(engine.health())
    assert (health.address, health.healthy, health.adapters) == ("in-process", True, ("policy-v1",))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_base_equals_hf_generate_with_raw_logit_logprobs(tiny_model_dirs, prompt, arch):
    engine = ReferenceEngine(tiny_model_dirs[arch])
    model = load_model(tiny_model_dirs[arch])
    [completion] = generate(engine, prompt=prompt)
    tokens, logprobs = hf_greedy(model, prompt)
    assert list(completion.token_ids) == tokens
    assert close(completion.logprobs, logprobs)
    assert close(completion.logprobs, sequence_logprobs(model, prompt, completion.token_ids))
    assert completion.finish_reason == "length"
    assert completion.text == load_tokenizer(tiny_model_dirs[arch]).decode(tokens, skip_special_tokens=True)


def test_greedy_with_adapter_equals_peft_generate_and_differs_from_base(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    run(engine.load_adapter("policy.v1", str(dirs["A"])))  # a dotted name: PEFT's own names are internal
    [completion] = generate(engine, prompt=prompt, adapter="policy.v1")
    peft_model = load_adapter(load_model(dirs["base"]), dirs["A"])
    tokens, logprobs = hf_greedy(peft_model, prompt)
    assert list(completion.token_ids) == tokens
    assert close(completion.logprobs, logprobs)
    assert close(completion.logprobs, sequence_logprobs(peft_model, prompt, completion.token_ids))
    assert list(generate(engine, prompt=prompt)[0].token_ids) == hf_greedy(load_model(dirs["base"]), prompt)[0]
    assert generate(engine, prompt=prompt)[0].token_ids != completion.token_ids


def test_several_adapters_switch_unload_and_reload(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    [base] = generate(engine, prompt=prompt)
    run(engine.load_adapter("a-v1", str(dirs["A"])))
    run(engine.load_adapter("b-v1", str(dirs["B"])))
    assert run(engine.list_adapters()) == ["a-v1", "b-v1"]
    [a], [b] = generate(engine, prompt=prompt, adapter="a-v1"), generate(engine, prompt=prompt, adapter="b-v1")
    assert len({a.token_ids, b.token_ids, base.token_ids}) == 3
    assert generate(engine, prompt=prompt) == [base]
    assert generate(engine, prompt=prompt, adapter="a-v1") == [a]

    run(engine.unload_adapter("a-v1"))
    assert run(engine.list_adapters()) == ["b-v1"]
    assert generate(engine, prompt=prompt, adapter="b-v1") == [b]
    run(engine.unload_adapter("b-v1"))
    assert run(engine.list_adapters()) == []
    assert generate(engine, prompt=prompt) == [base]
    run(engine.load_adapter("a-v2", str(dirs["A"])))  # after the last unload: a fresh PEFT wrap
    assert generate(engine, prompt=prompt, adapter="a-v2") == [a]


def test_sampling_is_repeatable_per_seed_and_reports_raw_logprobs(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=7)
    first = generate(engine, params, prompt)
    assert len(first) == 3 and generate(engine, params, prompt) == first
    assert len({c.token_ids for c in first}) == 3  # n samples are not copies of one another
    # sample j of a seeded request is what a single sample seeded seed + j gives
    single = SamplingParams(n=1, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=8)
    assert generate(engine, single, prompt) == [first[1]]
    other = generate(engine, SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=100), prompt)
    assert {c.token_ids for c in other}.isdisjoint({c.token_ids for c in first})
    model = load_model(dirs["base"])
    for completion in first:  # log-probs ignore temperature and top-p: raw log-softmax of the logits
        assert close(completion.logprobs, sequence_logprobs(model, prompt, completion.token_ids))


def test_tiny_top_p_is_greedy(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    nucleus = generate(engine, SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=16, seed=3), prompt)
    assert nucleus == generate(engine, GREEDY, prompt) * 2


def test_sample_token_draws_from_the_tempered_nucleus():
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature, top_p, draws = 1.5, 0.75, 4000
    probs_V = torch.softmax(logits_V / temperature, -1)
    assert probs_V[:2].sum() < top_p < probs_V[:3].sum()  # the nucleus is the top 3 tokens
    expected_V = torch.cat([probs_V[:3] / probs_V[:3].sum(), torch.zeros(2)])
    generator = torch.Generator().manual_seed(0)
    counts_V = torch.bincount(torch.tensor([sample_token(logits_V, temperature, top_p, generator)
                                            for _ in range(draws)]), minlength=5)
    assert torch.allclose(counts_V / draws, expected_V, atol=0.03)
    assert sample_token(logits_V, 0.0, 0.5, generator) == 0


def test_top_k_keeps_the_k_most_probable_tokens():
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    generator = torch.Generator().manual_seed(0)
    draws = {sample_token(logits_V, 2.0, 1.0, generator, top_k=2) for _ in range(400)}
    assert draws == {0, 1}
    assert {sample_token(logits_V, 2.0, 1.0, generator, top_k=0) for _ in range(400)} == set(range(5))


def test_a_stop_token_id_ends_the_sample_even_with_ignore_eos(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    tokens = list(generate(engine, GREEDY, prompt)[0].token_ids)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, stop_token_ids=(tokens[k],))
    [stopped] = generate(engine, params, prompt)
    assert list(stopped.token_ids) == tokens[:k + 1] and stopped.finish_reason == "stop"
    top1 = SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=16, seed=4)
    assert generate(engine, top1, prompt) == generate(engine, GREEDY, prompt) * 2


def test_eos_stops_with_stop_unless_ignore_eos(dirs, prompt, tmp_path):
    """Greedy text of a random model rarely reaches <|im_end|>, so declare one of the tokens greedy
    does emit an eos id in the generation config (as Qwen configs list several eos ids)."""
    tokens = list(generate(ReferenceEngine(dirs["base"]), GREEDY, prompt)[0].token_ids)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    model_dir = Path(shutil.copytree(dirs["base"], tmp_path / "model"))
    config = json.loads((model_dir / "generation_config.json").read_text())
    assert tokens[k] != config["eos_token_id"] and config["eos_token_id"] not in tokens
    config["eos_token_id"] = [config["eos_token_id"], tokens[k]]
    (model_dir / "generation_config.json").write_text(json.dumps(config))

    engine = ReferenceEngine(model_dir)
    [stopped] = generate(engine, GREEDY, prompt)
    assert list(stopped.token_ids) == tokens[:k + 1] == hf_greedy(load_model(model_dir), prompt)[0]
    assert stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == k + 1  # the eos token is kept, with its log-prob; not its text
    assert stopped.text == load_tokenizer(model_dir).decode(tokens[:k], skip_special_tokens=True)
    [ignored] = generate(engine, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True), prompt)
    assert list(ignored.token_ids) == tokens and ignored.finish_reason == "length"


def test_stop_string_ends_the_sample_and_is_cut_from_the_text(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    tokenizer = load_tokenizer(dirs["base"])
    [full] = generate(engine, GREEDY, prompt)
    tokens = list(full.token_ids)
    # a stop string spanning the boundary between the 2nd and 3rd generated tokens
    boundary = len(tokenizer.decode(tokens[:2]))
    assert full.text.startswith(tokenizer.decode(tokens[:2])) and len(full.text) > boundary + 2
    stop = full.text[boundary - 1:boundary + 2]
    k = next(k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    expected_text = tokenizer.decode(tokens[:k])[:tokenizer.decode(tokens[:k]).index(stop)]

    [stopped] = generate(engine, SamplingParams(temperature=0.0, max_new_tokens=16, stop=("never here", stop)), prompt)
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == tokens[:k] and stopped.logprobs == full.logprobs[:k]
    assert stopped.text == expected_text and stop not in stopped.text
    [unmatched] = generate(engine, SamplingParams(temperature=0.0, max_new_tokens=16, stop=("never here",)), prompt)
    assert unmatched == full


def test_adapter_lifecycle_errors_leave_the_engine_working(dirs, prompt, tmp_path):
    engine = ReferenceEngine(dirs["base"])
    run(engine.load_adapter("a-v1", str(dirs["A"])))
    [before] = generate(engine, prompt=prompt, adapter="a-v1")
    [base] = generate(engine, prompt=prompt)

    with pytest.raises(UnknownAdapterError, match="The model `nope-v1` does not exist"):
        run(engine.unload_adapter("nope-v1"))
    with pytest.raises(UnknownAdapterError, match="nope-v1"):
        generate(engine, prompt=prompt, adapter="nope-v1")
    with pytest.raises(AdapterAlreadyLoadedError, match="a-v1"):
        run(engine.load_adapter("a-v1", str(dirs["B"])))

    corrupt = Path(shutil.copytree(dirs["A"], tmp_path / "corrupt"))
    (corrupt / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "missing", tmp_path / "empty", corrupt, dirs["base"], dirs["wide_adapter"]):
        with pytest.raises(BadRequestError, match=str(bad)):
            run(engine.load_adapter("bad-v1", str(bad)))
        assert run(engine.list_adapters()) == ["a-v1"]
    assert generate(engine, prompt=prompt, adapter="a-v1") == [before]
    assert generate(engine, prompt=prompt) == [base]

    fresh = ReferenceEngine(dirs["base"])  # a failed FIRST load must leave the base unwrapped
    with pytest.raises(BadRequestError, match="shape"):
        run(fresh.load_adapter("bad-v1", str(dirs["wide_adapter"])))
    assert generate(fresh, prompt=prompt) == [base]
    assert all(".lora_" not in n and "base_layer" not in n for n, _ in fresh._base.named_parameters())


def test_bad_requests_are_rejected(dirs):
    engine = ReferenceEngine(dirs["base"])
    with pytest.raises(BadRequestError, match="empty"):
        generate(engine, prompt=())
    with pytest.raises(BadRequestError, match="out of vocabulary"):
        generate(engine, prompt=(1, 10**6))


def test_reload_weights_serves_the_new_model_with_adapters_kept(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    run(engine.load_adapter("a-v1", str(dirs["A"])))
    run(engine.reload_weights(str(dirs["seed1"])))
    [base] = generate(engine, prompt=prompt)
    [adapted] = generate(engine, prompt=prompt, adapter="a-v1")
    tokens, logprobs = hf_greedy(load_model(dirs["seed1"]), prompt)
    assert list(base.token_ids) == tokens and close(base.logprobs, logprobs)
    assert list(adapted.token_ids) == hf_greedy(load_adapter(load_model(dirs["seed1"]), dirs["A"]), prompt)[0]
    assert tokens != hf_greedy(load_model(dirs["base"]), prompt)[0]


def test_reload_merged_export_serves_what_the_adapter_served(dirs, prompt):
    engine = ReferenceEngine(dirs["base"])
    run(engine.load_adapter("a-v1", str(dirs["A"])))
    [adapted] = generate(engine, prompt=prompt, adapter="a-v1")
    run(engine.unload_adapter("a-v1"))
    run(engine.reload_weights(str(dirs["merged_A"])))
    [merged] = generate(engine, prompt=prompt)
    assert merged.token_ids == adapted.token_ids
    assert close(merged.logprobs, adapted.logprobs, tol=1e-4)  # merged weights round differently


def test_reload_mismatch_is_rejected_and_changes_nothing(dirs, prompt, tmp_path):
    engine = ReferenceEngine(dirs["base"])
    run(engine.load_adapter("a-v1", str(dirs["A"])))
    [base], [adapted] = generate(engine, prompt=prompt), generate(engine, prompt=prompt, adapter="a-v1")
    before = {n: p.detach().clone() for n, p in engine._base.named_parameters()}

    # same-shape seed-1 tensors with one dropped or one added: nothing may be copied before the check
    good = safetensors.torch.load_file(dirs["seed1"] / "model.safetensors")
    for name, tensors in (("missing", {k: v for k, v in good.items() if k != "lm_head.weight"}),
                          ("extra", {**good, "model.extra.weight": torch.zeros(2)})):
        (tmp_path / name).mkdir()
        safetensors.torch.save_file(tensors, tmp_path / name / "model.safetensors")
    cases = {dirs["wide"]: r"shape mismatch for tensor lm_head.weight: \(1024, 96\)",
             tmp_path / "missing": "tensor lm_head.weight is missing",
             tmp_path / "extra": "unexpected tensor model.extra.weight",
             tmp_path: "no model.safetensors"}
    for path, message in cases.items():
        with pytest.raises(BadRequestError, match=message):
            run(engine.reload_weights(str(path)))

    after = dict(engine._base.named_parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert generate(engine, prompt=prompt) == [base]
    assert generate(engine, prompt=prompt, adapter="a-v1") == [adapted]


# --- devices -------------------------------------------------------------------------------------

def test_auto_device_is_the_gpu_when_torch_sees_one():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there to be asked for")
def test_asking_for_cuda_without_a_gpu_names_the_setting(dirs):
    with pytest.raises(ValueError, match="rollout.reference_device"):
        ReferenceEngine(dirs["base"], device="cuda")


@pytest.mark.gpu
def test_on_cuda_the_engine_serves_base_adapters_and_reloaded_weights_like_the_trainer(dirs, prompt):
    engine = ReferenceEngine(dirs["base"], device="auto")
    assert engine.device.type == "cuda"
    base_model = load_model(dirs["base"])
    [base] = generate(engine, prompt=prompt)
    assert close(base.logprobs, sequence_logprobs(base_model, prompt, base.token_ids), tol=1e-4)  # CPU forward
    assert close(base.logprobs, sequence_logprobs(base_model.cuda(), prompt, base.token_ids))  # same device

    run(engine.load_adapter("a-v1", str(dirs["A"])))
    [adapted] = generate(engine, prompt=prompt, adapter="a-v1")
    peft_model = load_adapter(load_model(dirs["base"]), dirs["A"]).cuda()
    assert close(adapted.logprobs, sequence_logprobs(peft_model, prompt, adapted.token_ids))
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=12, seed=7)
    assert generate(engine, params, prompt, adapter="a-v1") == generate(engine, params, prompt, adapter="a-v1")

    run(engine.unload_adapter("a-v1"))
    run(engine.reload_weights(str(dirs["merged_A"])))
    [merged] = generate(engine, prompt=prompt)
    assert merged.token_ids == adapted.token_ids and close(merged.logprobs, adapted.logprobs, tol=1e-4)
