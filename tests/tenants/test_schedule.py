"""The scheduler's second line of isolation (graft.tenants.schedule): when a shared pass fails for a
reason no parse check caught, every tenant's gradients are put back and each operation runs alone,
so only the one at fault fails and the others' gradients equal what their own pass alone gives."""

from __future__ import annotations

import asyncio
import random

import torch

from graft.models.loading import load_model
from graft.tenants.futures import Futures, RequestFailed
from graft.tenants.policy import Datum, TenantPolicy, TenantSpec
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
