"""Tenants' adapters trained in shared batches on several ranks: `ShardedTenantPolicy`.

The one-process `TenantPolicy` (graft.tenants.policy) parallelised by graft's own `parallelize`
(graft.parallel.parallelize): tensor parallelism over the mesh's `tp` dimension, every tenant's LoRA
factors split with their layer, then FSDP2 over `dp`. Each data-parallel rank runs
`forward_backward` on its own share of the datums (the ranks of one TP group on the same share),
and each tenant's gradient is the SUM over ranks of its datums' gradients: the losses are sums
(graft.tenants.losses), so that sum is what one process gets from all the datums, and `apply_fsdp`
already reduces by summing (divide factor 1).

Tenants are fixed when the policy is built. FSDP2 and TP wrap parameters once: FSDP2 flattens each
decoder layer's parameters into the buffers it all-gathers and reduce-scatters, and TP turns the LoRA
factors into DTensors, so an adapter added afterwards would be a plain tensor outside both. `add`
refuses; changing the set of tenants means building a new policy.

Every rank calls every method in the same order with the same tenants (`forward_backward` with its
own share): each is a collective. A share that holds no datum at all runs a stand-in forward; a
share refused (an unknown tenant, missing inputs) is refused on every rank, before anything runs.

A tenant absent from one rank's datums still takes part in every collective: FSDP2 reduce-scatters
only the parameters with a gradient, and ranks that disagreed on which ones would exchange buffers of
different layouts. `set_reduce_scatter_unused_params` gives the absent tenant's factors zero
gradients there, so every rank reduces the same parameters. Zeros are not "no gradient", so whether
a tenant had datums since its last step is decided over all ranks in `optim_step`, with its gradient
norm, in one all-reduce: every rank then makes the same decision (step, refuse a non-finite
gradient, or nothing to step) and clips by the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from graft.lora.routing import routed
from graft.parallel.dist import Dist, all_reduce_max, all_reduce_sum, full_tensor, shard_like
from graft.parallel.parallelize import check_tensor_parallel, parallelize, reduce_unused_as_zeros, reshard
from graft.tenants.losses import LOSSES
from graft.tenants.policy import (
    Datum,
    DatumResult,
    TenantError,
    TenantPolicy,
    TenantSpec,
    TenantState,
)


class ShardedTenantPolicy(TenantPolicy):
    """`specs`' tenants on `base`, parallelised on `ctx`'s (dp, tp) mesh (module docstring). Every rank
    builds it with the same `specs` in the same order (a collective: FSDP2 and TP shard here).

    Raises:
        TenantError: no tenants, or a name `TenantPolicy.add` refuses.
        ValueError: `ctx.tp` cannot split the model or a tenant's target modules
            (`check_tensor_parallel`), or `batch_invariant` with tensor parallelism (its blocked base
            GEMMs run on plain tensors, TP's are DTensors).
    """

    def __init__(self, base: nn.Module, specs: Sequence[TenantSpec], ctx: Dist, *, pad_id: int = 0,
                 batch_invariant: bool = False) -> None:
        if not specs:
            raise TenantError("a sharded policy needs its tenants up front: FSDP2 and TP shard every adapter once")
        if batch_invariant and ctx.tp > 1:
            raise ValueError(f"batch_invariant runs with data parallelism only, not tp={ctx.tp}")
        super().__init__(base, pad_id, batch_invariant=batch_invariant)
        for spec in specs:
            check_tensor_parallel(base.config, ctx.tp, spec.target_modules)
        for spec in specs:
            super().add(spec)
        self.ctx = ctx
        parallelize(self.model, ctx)
        reduce_unused_as_zeros(self.model)
        # The sharded parameters are new Parameter objects: each tenant's AdamW must hold those.
        self._optimizers = {name: torch.optim.AdamW(self.parameters(name).values()) for name in self.tenants}
        self._pending: set[str] = set()  # tenants with datums on this rank since their last step

    def add(self, spec: TenantSpec) -> None:
        """Refused: a sharded policy's tenants are fixed when it is built (module docstring)."""
        raise TenantError(f"cannot add tenant {spec.name!r}: a sharded policy's tenants are fixed when it is built "
                          f"(FSDP2 and TP shard each adapter once); tenants: {', '.join(self.tenants)}")

    def forward_backward(self, datums: Sequence[Datum], loss: str, *, backward: bool = True,
                         config: Mapping[str, float] | None = None) -> list[DatumResult]:
        """`TenantPolicy.forward_backward` on this rank's share of the datums: every rank calls it
        (each data-parallel rank with its own share, the same share on the ranks of one TP group),
        also when its share holds no datum of some tenant, or none at all (then a stand-in joins the
        collectives, with a zero loss). Its results are this rank's datums'.

        Every rank checks its share first and learns whether any rank's was refused (one all-reduce):
        a rank that raised alone would leave the others waiting in the forward's collectives.

        Raises:
            TenantError: on every rank, when any rank's share is refused as `TenantPolicy.forward_backward`
                refuses (an empty share aside); nothing ran and no gradient changed.
        """
        refused = None
        if datums or loss not in LOSSES:
            try:
                self._check(datums, loss, config)
            except TenantError as e:
                refused = e
        if self._on_any_rank(refused is not None):
            raise refused or TenantError("forward_backward refused: another rank's share was refused (its rank "
                                         "raised the reason); nothing ran")
        passes = len(self._passes(datums))
        most = int(self._max_over_ranks(passes))  # every rank makes as many passes (each one collectives)
        for _ in range(most - passes):
            self._stand_in(backward)
        if not datums:
            return []
        results = super().forward_backward(datums, loss, backward=backward, config=config)
        if backward:
            self._pending.update(datum.tenant for datum in datums)
        return results

    def _pass(self, datums: Sequence[Datum], losses_fn, needs, backward: bool) -> list[DatumResult]:
        results = super()._pass(datums, losses_fn, needs, backward)
        if not backward:  # FSDP2's root unit stays unsharded after a forward without a backward, and the
            reshard(self.model)  # next pass's all-gather must be one every rank makes (a stand-in's too)
        return results

    def _on_any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a collective)."""
        return bool(self._max_over_ranks(float(flag)))

    def _max_over_ranks(self, value: float) -> float:
        """The largest `value` of all ranks (a collective)."""
        if not self.ctx.active:
            return value
        values = torch.tensor([float(value)], device=self.ctx.device)
        all_reduce_max(values)
        return values.item()

    def _stand_in(self, backward: bool) -> None:
        """The forward (and backward) of a rank without datums: FSDP2 all-gathers each decoder layer in
        the forward and reduce-scatters its gradients in the backward, collectives the other ranks wait
        in; TP's run within the tp group, whose ranks share this (empty) share. The token goes through
        the first tenant's adapter: without a trainable factor in its graph there would be no backward
        (and no reduce-scatter) at all. Its loss is zero times the logits: zero gradients, and like
        every tenant without datums here, that tenant gets no more than zeros from this rank."""
        ids_BT = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.ctx.device)
        self.model.train()
        with routed(self.model, torch.zeros_like(ids_BT), [next(iter(self.tenants))]), \
                torch.set_grad_enabled(backward):
            logits = self.model(input_ids=ids_BT, use_cache=False).logits
        if backward:
            (logits.sum() * 0).backward()
        else:
            reshard(self.model)

    def logprobs(self, tenant: str, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """`TenantPolicy.logprobs` on the sharded model: a collective, every rank calls it with the same
        arguments (and gets the same log-probs)."""
        try:
            return super().logprobs(tenant, prompt, completion)
        finally:
            reshard(self.model)

    def full_parameters(self, tenant: str) -> dict[str, torch.Tensor]:
        """`tenant`'s whole LoRA factors, as one process holds them (a collective on every rank)."""
        return {name: full_tensor(param.detach()) for name, param in self.parameters(tenant).items()}

    def tenant_state(self, tenant: str) -> TenantState:
        """`tenant`'s whole factors, gradients and AdamW state, as one process holds them (a collective
        on every rank; which gradients exist is the same on every rank: FSDP2 gives each tenant's
        factors a gradient on every rank at each backward, zeros where it had no datums)."""
        state = super().tenant_state(tenant)
        return TenantState({name: full_tensor(t).clone() for name, t in state.params.items()},
                           {name: None if g is None else full_tensor(g).clone() for name, g in state.grads.items()},
                           {name: {key: full_tensor(v).clone() for key, v in m.items()}
                            for name, m in state.moments.items()})

    def set_tenant_state(self, tenant: str, state: TenantState) -> None:
        """Put `state` (whole tensors, the same on every rank: `tenant_state`'s) into `tenant`'s shards,
        bit for bit (a collective on every rank). AdamW's step count stays whole; its moments are
        sharded as their parameter."""
        optimizer = self.optimizer(tenant)
        with torch.no_grad():
            for name, param in self.parameters(tenant).items():
                whole = state.params[name]
                param.copy_(shard_like(whole.to(self.ctx.device), param))
                grad = state.grads[name]
                param.grad = None if grad is None else shard_like(grad.to(self.ctx.device), param)
                optimizer.state[param] = {key: shard_like(v, param) if v.shape == whole.shape else v
                                          for key, v in state.moments[name].items()}
                if not optimizer.state[param]:
                    del optimizer.state[param]

    def _grad_norm(self, tenant: str, params: list[nn.Parameter]) -> tuple[bool, float]:
        """(whether any rank had datums of `tenant` since its last step, the norm of its whole
        gradient): each rank's share of the squares, weighted by how many ranks hold the same elements,
        and its flag, summed in one all-reduce that every rank joins. So every rank refuses a non-finite
        gradient alike, wherever the NaN came from, and clips alike; `optim_step` (every rank calls it
        for the same tenants in the same order) then steps the local shards. An absent tenant's zeros
        (module docstring) are not "seen"."""
        device = self.ctx.device
        squares = sum((_local(p.grad).double().pow(2).sum().to(device) * self._weight(p.grad) for p in params
                       if p.grad is not None), torch.zeros((), dtype=torch.float64, device=device))
        totals = torch.stack([squares, torch.tensor(float(tenant in self._pending), dtype=torch.float64,
                                                    device=device)])
        self._pending.discard(tenant)
        if self.ctx.active:
            all_reduce_sum(totals)
        squares, seen = totals.tolist()
        return seen > 0, math.sqrt(squares)

    def _weight(self, grad: torch.Tensor) -> float:
        """1 / how many ranks hold each element of `grad` (a DTensor is sharded over some mesh
        dimensions and repeated over the rest of the world; a plain tensor is whole everywhere)."""
        placements = getattr(grad, "placements", None)
        if placements is None:
            return 1.0 / self.ctx.world_size
        shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(placements) if p.is_shard())
        return shards / self.ctx.world_size


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
