"""Tenants trained in shared batches on 2 CPU ranks (gloo; graft.tenants.sharded): with FSDP2 (dp=2)
and with tensor parallelism (tp=2), each rank training on its own share of the datums, the ranks do
what one process does with the same batches (dp: 1e-6 relative; tp: 1e-5, its split matmuls round
otherwise), and each tenant ends where it would alone on one process on all its datums (grad norms
to 1e-6, adapters to Adam's rounding, see `_assert_like_alone`), also a tenant whose datums all sit
on one rank and a rank without datums; a tenant with a NaN datum on one rank is refused its step on
every rank, and the others go on."""

import dataclasses
import json
import random

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from graft.models.loading import load_model
from graft.models.tiny import build_tiny_model
from graft.parallel.dist import Dist, mesh_dist
from graft.tenants.policy import AdamParams, Datum, TenantError, TenantPolicy
from graft.tenants.sharded import ShardedTenantPolicy
from tests.helpers import assert_adam_weights_close
from tests.parallel.test_dist import init_gloo
from tests.spawn import spawn_ranks
from tests.tenants.test_policy import SPECS, _datums, _interleaved

WORLD = 2
STEPS = 3
LOSS = "importance_sampling"
# Padded tokens per pass: the ranks' shares (of different sizes) take different numbers of passes,
# and the rank with fewer joins the others' collectives with stand-ins.
PASS_TOKENS = 40
PROBE = ([5, 17, 42, 9], [33, 7, 101])  # a prompt and completion each run scores after training
ON_RANK_0 = {"alice": 2, "bob": 1, "carol": 3}  # of each tenant's 3 datums a step; carol's all on rank 0
_ADAM = {"alice": AdamParams(learning_rate=1e-2), "bob": AdamParams(learning_rate=3e-3, beta2=0.99),
         "carol": AdamParams(learning_rate=2e-2, weight_decay=0.1)}


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    """A tiny fp32 qwen2 that TP can split by 2 (hidden 128: 4 heads, 2 KV heads), 2 layers."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tp") / "qwen2", hidden=128, layers=2, seed=0)


def _adam(tenant: str, step: int) -> AdamParams:
    """Each tenant's settings at `step`: another learning rate every step, its gradient clipped at
    the last (to below its norm: the clipping is applied, by the same factor on every rank)."""
    adam = _ADAM[tenant]
    return dataclasses.replace(adam, learning_rate=adam.learning_rate * (step + 1) / 2,
                               grad_clip_norm=1e-3 if step == STEPS - 1 else 0.0)


def _shares(step: int, poison: str | None = None) -> list[list[Datum]]:
    """Each data-parallel rank's datums at `step`: three of each tenant, split unevenly (`ON_RANK_0`),
    mixed within each rank; at the last step all on rank 0 (rank 1 has none). The `poison` tenant's
    first datum on rank 1 has NaN advantages at step 1."""
    shares: list[list[Datum]] = [[], []]
    for spec in SPECS:
        datums = _datums(spec.name, step, LOSS) + _datums(spec.name, step + STEPS, LOSS)[:1]
        on_rank_0 = ON_RANK_0[spec.name] if step < STEPS - 1 else len(datums)
        shares[0] += datums[:on_rank_0]
        shares[1] += datums[on_rank_0:]
    if poison is not None and step == 1:
        at = next(i for i, d in enumerate(shares[1]) if d.tenant == poison)
        tokens, inputs = shares[1][at].tokens, shares[1][at].inputs
        shares[1][at] = Datum(poison, tokens, {**inputs, "advantages": [float("nan")] * (len(tokens) - 1)})
    return [_interleaved(share, random.Random(f"{step}-{rank}")) for rank, share in enumerate(shares)]


def _rank_main(rank: int, tp: int, model_dir, out_dir, poison: str | None) -> None:
    init_gloo(rank, WORLD, out_dir / "rendezvous")
    try:
        ctx = mesh_dist(tp)
        policy = ShardedTenantPolicy(load_model(model_dir), SPECS, ctx)
        policy.pass_tokens = PASS_TOKENS
        share = _shares(0)[ctx.dp_rank] if rank == 0 else [Datum("zed", [1, 2, 3], {})]  # rank 1's refused
        try:
            policy.forward_backward(share, LOSS)
            refused = ""
        except TenantError as e:
            refused = str(e)
        steps, losses = [], []
        for step in range(STEPS):
            share = _shares(step, poison)[ctx.dp_rank]
            losses.append([r.loss for r in policy.forward_backward(share, LOSS, backward=False)])
            policy.forward_backward(share, LOSS)
            steps.append({spec.name: dataclasses.asdict(policy.optim_step(spec.name, _adam(spec.name, step)))
                          for spec in SPECS})
        weights = {name: t.contiguous() for spec in SPECS for name, t in policy.full_parameters(spec.name).items()}
        probe = policy.logprobs("alice", *PROBE)
        (out_dir / f"steps-{rank}.json").write_text(json.dumps({"steps": steps, "losses": losses, "refused": refused,
                                                                "logprobs": probe}))
        if rank == 0:
            safetensors.torch.save_file(weights, out_dir / "lora.safetensors")
    finally:
        dist.destroy_process_group()


def _one_process(model_dir, specs, *, ranks=(0, 1), steps=range(STEPS), poison=None):
    """`specs`' tenants together on one process at `steps`, each step accumulating one
    `forward_backward` per data-parallel rank's share (of `ranks`, in rank order; their datums of
    `specs` only), then each tenant's step: the policy, each step's results by tenant, and each rank's
    share's losses before each step (a forward without backward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels
    try:
        policy = TenantPolicy(load_model(model_dir), pass_tokens=PASS_TOKENS)
        results, losses = [], {rank: [] for rank in ranks}
        for spec in specs:
            policy.add(spec)
        names = {spec.name for spec in specs}
        for step in steps:
            shares = _shares(step, poison)
            mine = {rank: [d for d in shares[rank] if d.tenant in names] for rank in ranks}
            for rank in ranks:
                forward = policy.forward_backward(mine[rank], LOSS, backward=False) if mine[rank] else []
                losses[rank].append([r.loss for r in forward])
            for rank in ranks:
                if mine[rank]:
                    policy.forward_backward(mine[rank], LOSS)
            results.append({spec.name: dataclasses.asdict(policy.optim_step(spec.name, _adam(spec.name, step)))
                            for spec in specs})
        return policy, results, losses
    finally:
        torch.set_num_threads(threads)


def _relative_difference(sharded: dict[str, torch.Tensor], policy: TenantPolicy, tenant: str) -> float:
    theirs = {name: p.detach() for name, p in policy.parameters(tenant).items()}
    mine = {name: t for name, t in sharded.items() if name in theirs}
    assert mine.keys() == theirs.keys()
    return max((mine[k] - theirs[k]).norm().item() / theirs[k].norm().item() for k in mine)


def _run(model_dir, tmp_path, tp: int, poison: str | None = None) -> tuple[dict, list[dict]]:
    """The gathered adapters, and each rank's step results and forward-only losses."""
    spawn_ranks(_rank_main, (tp, model_dir, tmp_path, poison), WORLD)
    runs = [json.loads((tmp_path / f"steps-{rank}.json").read_text()) for rank in range(WORLD)]
    return safetensors.torch.load_file(tmp_path / "lora.safetensors"), runs


def _assert_like_one_process(model_dir, weights, runs, ranks, poison=None, tolerance=1e-6) -> None:
    """The sharded run did what one process does with the same batches (`ranks`: the data-parallel
    ranks' shares): every rank's step results (applied or refused, grad norms to 1e-6), its
    forward-only losses (1e-6, 1e-7 absolute), and the gathered adapters (within `tolerance`, relative)."""
    together, results, losses = _one_process(model_dir, SPECS, ranks=ranks, poison=poison)
    for rank, run in enumerate(runs):
        dp_rank = ranks[rank * len(ranks) // WORLD]
        assert [len(step) for step in run["losses"]] == [len(step) for step in losses[dp_rank]]
        for mine, theirs in zip(run["losses"], losses[dp_rank]):
            assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-7, nan_ok=True)  # a sum may cancel to ~0
        for mine, theirs in zip(run["steps"], results, strict=True):
            assert {t: (r["applied"], r["refused"]) for t, r in mine.items()} == \
                   {t: (r["applied"], r["refused"]) for t, r in theirs.items()}
            for tenant, result in theirs.items():
                assert mine[tenant]["grad_norm"] == pytest.approx(result["grad_norm"], rel=1e-6, nan_ok=True)
    for spec in SPECS:
        assert _relative_difference(weights, together, spec.name) <= tolerance, spec.name
    for run in runs:  # the trained alice's log-probs, computed on the sharded model
        assert run["logprobs"] == pytest.approx(together.logprobs("alice", *PROBE), rel=1e-5, abs=1e-6)


def _assert_like_alone(model_dir, weights, tenant, ranks, steps=range(STEPS)) -> list[dict]:
    """`tenant`'s gathered adapter is its own, trained alone on one process on its datums of the
    shares of `ranks` at `steps`, and it trained (every LoRA matrix moved); its one-process step results.

    The comparison is Adam's (tests.helpers): the other tenants' datums change each batch's padded
    width and size, so the base's kernels sum the same products in another order, and Adam turns the
    last-bit gradient differences of near-zero elements into step-sized ones. Measured on one
    process, without any rank: alice beside the others vs alone 3.5e-6 relative, her datums merely
    reordered 1.2e-5. The grad norms carry the tight check."""
    spec = next(spec for spec in SPECS if spec.name == tenant)
    alone, results, _ = _one_process(model_dir, [spec], ranks=ranks, steps=steps)
    assert _relative_difference(weights, alone, tenant) <= 2e-5
    mine = {name: t for name, t in weights.items() if f".{tenant}." in name}
    assert_adam_weights_close(mine, {k: p.detach() for k, p in alone.parameters(tenant).items()},
                              max(_adam(tenant, step).learning_rate for step in steps))
    start = TenantPolicy(load_model(model_dir))
    start.add(spec)
    assert min((mine[k] - p).norm().item() for k, p in start.parameters(tenant).items()) > 1e-4
    return results


def test_fsdp2_dp2_tenants_split_across_ranks_train_as_alone(base_dir, tmp_path):
    """dp=2: each rank its own share (carol's datums all on rank 0; at the last step rank 1 has none):
    one process's run of the same batches, and each tenant as trained alone; the last step's
    clipping was applied (norm > clip). A share refused on one rank is refused on both."""
    weights, runs = _run(base_dir, tmp_path, tp=1)
    # Before the steps, rank 1's share named an unknown tenant: both ranks raised, nothing ran.
    assert runs[1]["refused"].startswith("unknown tenant 'zed'")
    assert runs[0]["refused"].startswith("forward_backward refused: another rank's share was refused")
    _assert_like_one_process(base_dir, weights, runs, ranks=(0, 1))
    for spec in SPECS:
        results = _assert_like_alone(base_dir, weights, spec.name, ranks=(0, 1))
        norms = [r[spec.name]["grad_norm"] for r in results]
        for run in runs:
            assert [s[spec.name]["grad_norm"] for s in run["steps"]] == pytest.approx(norms, rel=1e-6)
        assert norms[-1] > _adam(spec.name, STEPS - 1).grad_clip_norm


def test_tp2_tenants_train_as_alone(tp_model_dir, tmp_path):
    """tp=2 (dp 1): both ranks run the same datums (dp rank 0's share); each tenant's split LoRA
    factors, gathered, are one process's of the same batches, and its own trained alone."""
    weights, runs = _run(tp_model_dir, tmp_path, tp=2)
    _assert_like_one_process(tp_model_dir, weights, runs, ranks=(0,), tolerance=1e-5)
    for spec in SPECS:
        _assert_like_alone(tp_model_dir, weights, spec.name, ranks=(0,))


def test_a_nan_datum_on_one_rank_refuses_its_tenant_on_every_rank(base_dir, tmp_path):
    """bob's datum on rank 1 has NaN advantages at step 1: bob's step is refused on both ranks (as on
    one process), the others step; bob ends as trained alone at steps 0 and 2 only, finite."""
    weights, runs = _run(base_dir, tmp_path, tp=1, poison="bob")
    _assert_like_one_process(base_dir, weights, runs, ranks=(0, 1), poison="bob")
    for rank_steps in (run["steps"] for run in runs):
        assert [s["bob"]["applied"] for s in rank_steps] == [True, False, True]
        assert rank_steps[1]["bob"]["refused"].startswith("non-finite")
        assert all(s[t]["applied"] for s in rank_steps for t in ("alice", "carol"))
    for tenant in ("alice", "carol"):
        _assert_like_alone(base_dir, weights, tenant, ranks=(0, 1))
    _assert_like_alone(base_dir, weights, "bob", ranks=(0, 1), steps=(0, 2))
    assert all(torch.isfinite(t).all() for name, t in weights.items() if ".bob." in name)


def test_tenants_are_fixed_when_a_sharded_policy_is_built(base_dir):
    policy = ShardedTenantPolicy(load_model(base_dir), SPECS[:2], Dist())
    with pytest.raises(TenantError, match="cannot add tenant 'carol': a sharded policy's tenants are fixed"):
        policy.add(SPECS[2])
    with pytest.raises(TenantError, match="needs its tenants up front"):
        ShardedTenantPolicy(load_model(base_dir), [], Dist())


def _invariant_main(rank: int, model_dir, out_dir) -> None:
    """On each rank: SPECS together with `batch_invariant`, then each tenant alone with it on the same
    shares (its datums only); whether each ends bit-equal."""
    init_gloo(rank, WORLD, out_dir / "rendezvous")
    try:
        ctx = mesh_dist(1)
        policies = {"together": ShardedTenantPolicy(load_model(model_dir), SPECS, ctx, batch_invariant=True)}
        for spec in SPECS:
            policies[spec.name] = ShardedTenantPolicy(load_model(model_dir), [spec], ctx, batch_invariant=True)
        for name, policy in policies.items():
            policy.pass_tokens = PASS_TOKENS
            for step in range(STEPS):
                share = [d for d in _shares(step)[ctx.dp_rank] if name == "together" or d.tenant == name]
                policy.forward_backward(share, LOSS)
                for tenant in policy.tenants:
                    policy.optim_step(tenant, _adam(tenant, step))
        together = {spec.name: policies["together"].full_parameters(spec.name) for spec in SPECS}
        equal = {spec.name: all(torch.equal(together[spec.name][k], t)
                                for k, t in policies[spec.name].full_parameters(spec.name).items()) for spec in SPECS}
        (out_dir / f"equal-{rank}.json").write_text(json.dumps(equal))
    finally:
        dist.destroy_process_group()


def test_batch_invariant_tenants_on_fsdp_ranks_end_bit_equal_to_themselves_alone_on_the_ranks(base_dir, tmp_path):
    """dp=2, each tenant's datums on the same ranks together and alone (carol's all on rank 0, rank 1
    without datums at the last step): the ranks' gradient sums are two terms, and the rest is each
    rank's own batch-invariant pass, so every tenant ends bit-equal."""
    spawn_ranks(_invariant_main, (base_dir, tmp_path), WORLD)
    for rank in range(WORLD):
        assert json.loads((tmp_path / f"equal-{rank}.json").read_text()) == {spec.name: True for spec in SPECS}
