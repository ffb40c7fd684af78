"""The scheduler's second line of isolation (graft.tenants.schedule): when a shared pass fails for a
reason no parse check caught, every tenant's gradients are put back and each operation runs alone,
so only the one at fault fails and the others' gradients equal what their own pass alone gives."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from graft.models.loading import load_model
from graft.tenants.futures import Futures, RequestFailed
from graft.tenants.policy import Datum, DatumResult, TenantPolicy, TenantSpec
from graft.tenants.schedule import FORWARD_BACKWARD, Model, Scheduler


class _Faulty(TenantPolicy):
    """A policy whose passes fail, after the gradients of their first datums are in, when they hold
    the tenant `poison`'s datum: a fault the parse checks do not know."""

    poison = "bad"

    def forward_backward(self, datums, loss, *, backward=True, config=None):
        if any(datum.tenant == self.poison for datum in datums):
            super().forward_backward(datums[:1], loss, backward=backward, config=config)  # a half-done pass
            raise RuntimeError("a kernel failed")
        return super().forward_backward(datums, loss, backward=backward, config=config)


def _datums(tenant: str, seed: int) -> list[Datum]:
    rng = random.Random(seed)
    tokens = [rng.randrange(3, 200) for _ in range(10)]
    return [Datum(tenant, tokens, {"weights": [1.0] * 9})]


def _grads(policy: TenantPolicy, tenant: str) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in policy.parameters(tenant).items() if param.grad is not None}


def test_a_failed_shared_pass_fails_only_the_op_at_fault(base_dir):
    faulty = _Faulty(load_model(base_dir))
    alone = TenantPolicy(load_model(base_dir))
    for policy in (faulty, alone):
        for tenant in ("good", "bad"):
            policy.add(TenantSpec(tenant, rank=2, alpha=2.0, seed=1))
    alone.forward_backward(_datums("good", 0), "cross_entropy")  # a step's first pass, then the shared one
    alone.forward_backward(_datums("good", 1), "cross_entropy")
    faulty.forward_backward(_datums("good", 0), "cross_entropy")

    async def scenario():
        futures = Futures()

        async def run_on_model(job):
            return job()

        scheduler = Scheduler(faulty, futures, run_on_model, single=None, batch_window_s=0.05)
        models = {tenant: Model(f"{tenant}-model", "user", tenant, 2) for tenant in ("good", "bad")}
        scheduler.models.update(models)
        task = asyncio.get_running_loop().create_task(scheduler.run())
        ids = {tenant: scheduler.submit(models[tenant], 1, FORWARD_BACKWARD, {
            "datums": _datums(tenant, 1), "loss": "cross_entropy", "config": {}, "forward_only": False})
            for tenant in ("good", "bad")}
        results = {tenant: await futures.wait("user", ids[tenant], 60) for tenant in ids}
        task.cancel()
        return results

    results = asyncio.run(scenario())
    assert isinstance(results["bad"], RequestFailed) and not isinstance(results["good"], RequestFailed)
    expected, got = _grads(alone, "good"), _grads(faulty, "good")
    assert expected.keys() == got.keys() and expected
    worst = max(((got[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-12)).item() for k in expected)
    assert worst <= 1e-6, f"the good tenant's gradients differ from its own passes by {worst:.2e}"
    assert _grads(faulty, "bad") == {}, "the failed op left gradients behind"


class _Recorder:
    """A policy stand-in whose passes take `pass_s` and record which tenants each held."""

    def __init__(self, pass_s: float = 0.0) -> None:
        self.pass_s, self.passes = pass_s, []

    def forward_backward(self, datums, loss, *, backward=True, config=None):
        time.sleep(self.pass_s)
        self.passes.append(sorted({datum.tenant for datum in datums}))
        return [DatumResult(0.0, []) for _ in datums]

    def parameters(self, tenant):
        return {}


def _gathering(policy: _Recorder, window_s: float, script, training: tuple[str, ...] = ()) -> dict[str, float]:
    """Run `script(submit)` against a scheduler whose tenants `training` are in their training phase
    (a pass arrived 4 s ago, their step takes 5 s); each op's seconds from submit to its result."""
    async def scenario():
        futures, pool = Futures(), ThreadPoolExecutor(1)
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(policy, futures, lambda job: loop.run_in_executor(pool, job), single=None,
                              batch_window_s=window_s)
        waits = {}
        for tenant in training:
            scheduler.models[tenant] = Model(tenant, "user", tenant, 2, last_arrived_s=time.monotonic() - 4.0,
                                             period_s=5.0)

        async def submit(tenant: str, seq_id: int) -> None:
            model = scheduler.models.setdefault(tenant, Model(tenant, "user", tenant, 2))
            start = time.monotonic()
            request = scheduler.submit(model, seq_id, FORWARD_BACKWARD, {
                "datums": [Datum(tenant, [1, 2, 3], {"weights": [1.0, 1.0]})], "loss": "cross_entropy",
                "config": {}, "forward_only": False})
            result = await futures.wait("user", request, 30)
            assert not isinstance(result, RequestFailed), result
            waits[f"{tenant}{seq_id}"] = time.monotonic() - start

        task = loop.create_task(scheduler.run())
        await script(submit)
        task.cancel()
        pool.shutdown()
        return waits

    return asyncio.run(scenario())


def test_a_lone_tenants_pass_runs_at_once_whatever_the_window():
    policy = _Recorder()

    async def script(submit):
        await submit("a", 1)
        await submit("a", 2)  # now in its training phase, and alone in it

    waits = _gathering(policy, 5.0, script)
    assert policy.passes == [["a"], ["a"]]
    assert max(waits.values()) < 1.0, waits


def test_a_pass_waits_for_a_tenant_in_its_training_phase_and_no_longer():
    policy = _Recorder()

    async def script(submit):
        late = asyncio.create_task(asyncio.sleep(0.3))
        first = asyncio.create_task(submit("a", 1))
        await late
        await asyncio.gather(first, submit("b", 1))
        await submit("a", 2)  # b is expected but does not come: the pass goes at the window's end

    waits = _gathering(policy, 1.0, script, training=("a", "b"))
    assert policy.passes == [["a", "b"], ["a"]]
    assert 0.25 < waits["a1"] < 0.9 and 0.9 < waits["a2"] < 2.0, waits


def test_passes_arriving_during_a_pass_gather_into_the_next():
    policy = _Recorder(pass_s=0.5)

    async def script(submit):
        first = asyncio.create_task(submit("a", 1))
        await asyncio.sleep(0.1)
        await asyncio.gather(first, submit("b", 1), submit("c", 1))

    _gathering(policy, 0.0, script)
    assert policy.passes == [["a"], ["b", "c"]]
