"""The Tinker service's policy on 2 CPU ranks (gloo; graft.tenants.ranks): rank 0 calls a
`RankedTenantPolicy` as the service does, rank 1 follows its commands, and rank 0 gets what one
process's `TenantPolicy` gives for the same calls: tenants created and removed between passes (each
a rebuild of the sharded policy, a tenant's unstepped gradients carried over), shared passes, steps,
a refused pass, a state gathered and put back (save_state, load_state), log-probs and the
non-finite probe."""

import dataclasses
import json

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from graft.models.loading import load_model
from graft.models.tiny import build_tiny_model
from graft.parallel.dist import mesh_dist
from graft.tenants.policy import Datum, TenantError, TenantPolicy, TenantState
from graft.tenants.ranks import RankedSource, RankedTenantPolicy
from tests.helpers import assert_adam_weights_close
from tests.parallel.test_dist import init_gloo
from tests.spawn import spawn_ranks
from tests.tenants.test_policy import ADAM, SPECS, _datums

WORLD = 2
LOSS = "cross_entropy"
PROBE = ([5, 17, 42, 9], [33, 7, 101])


def _script(policy) -> tuple[dict, dict[str, torch.Tensor]]:
    """The same calls on either policy: its answers, and alice's and bob's weights (by PEFT name)."""
    alice, bob = SPECS[0].name, SPECS[1].name
    out = {"losses": [], "steps": []}

    def train(datums: list[Datum]) -> None:
        out["losses"].append([result.loss for result in policy.forward_backward(datums, LOSS)])

    policy.add(SPECS[0])
    train(_datums(alice, 0, LOSS) + _datums(alice, 1, LOSS))
    policy.add(SPECS[1])  # on ranks a rebuild: alice's gradients not yet stepped are carried over
    out["steps"].append(dataclasses.asdict(policy.optim_step(alice, ADAM[alice])))
    train(_datums(alice, 2, LOSS) + _datums(bob, 2, LOSS))
    out["steps"] += [dataclasses.asdict(policy.optim_step(name, ADAM[name])) for name in (alice, bob)]
    with pytest.raises(TenantError, match="unknown tenant 'zed'"):
        policy.forward_backward([Datum("zed", [1, 2, 3], {"weights": [1.0, 1.0]})], LOSS)
    weights = {name: t.clone() for name, t in policy.tenant_state(alice).params.items()}
    policy.remove(alice)  # a rebuild again: bob alone, his AdamW moments carried over
    train(_datums(bob, 3, LOSS))
    out["steps"].append(dataclasses.asdict(policy.optim_step(bob, ADAM[bob])))
    saved = _copied(policy.tenant_state(bob))
    train(_datums(bob, 4, LOSS))
    out["steps"].append(dataclasses.asdict(policy.optim_step(bob, ADAM[bob])))
    policy.set_tenant_state(bob, saved)  # as a load_state: bob as saved, his next step as before the save's
    train(_datums(bob, 4, LOSS))
    out["steps"].append(dataclasses.asdict(policy.optim_step(bob, ADAM[bob])))
    weights.update({name: t.clone() for name, t in policy.tenant_state(bob).params.items()})
    out["logprobs"] = policy.logprobs(bob, *PROBE)
    return out, weights


def _copied(state: TenantState) -> TenantState:
    return TenantState({k: t.clone() for k, t in state.params.items()}, {k: None for k in state.grads},
                       {k: {m: v.clone() for m, v in moments.items()} for k, moments in state.moments.items()})


def _published(policy: RankedTenantPolicy, weights: dict[str, torch.Tensor]) -> bool:
    """Whether what a publish of bob reads (`RankedSource`: his factors gathered, the model taken with
    them, as a source made during another tenant's rebuild must) is his adapter, and its probe finite."""
    bob = SPECS[1].name
    source = RankedSource(policy, bob, run=None)
    source.model = None  # as when it was made on the event loop while the model thread rebuilt
    tensors = source.lora_tensors()
    adapter = source.adapter()
    return (source.model is policy.model and tensors.keys() == {k for k in weights if f".{bob}." in k}
            and all(torch.equal(t, weights[k]) for k, t in tensors.items())
            and adapter.config["r"] == SPECS[1].rank and source.probe_logits_finite(PROBE[0]))


def _rank_main(rank: int, model_dir, out_dir, tp: int) -> None:
    init_gloo(rank, WORLD, out_dir / "rendezvous")
    try:
        policy = RankedTenantPolicy(model_dir, mesh_dist(tp))
        if rank > 0:
            policy.follow()
            return
        out, weights = _script(policy)
        out["probe"] = policy.probe_logits_finite(SPECS[1].name, PROBE[0])
        out["published"] = _published(policy, weights)
        out["rebuild_seconds"] = policy.rebuild_seconds
        policy.release_followers()
        (out_dir / "out.json").write_text(json.dumps(out))
        safetensors.torch.save_file({k: t.contiguous() for k, t in weights.items()}, out_dir / "lora.safetensors")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    """A tiny fp32 qwen2 that TP can split by 2 (hidden 128: 4 heads, 2 KV heads), 2 layers."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tp") / "qwen2", hidden=128, layers=2, seed=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_ranked_policy_answers_as_one_process_while_tenants_come_and_go(base_dir, tp_model_dir, tmp_path, tp):
    """FSDP2 over 2 ranks (tp 1: each its share of the datums), or tensor parallel (tp 2: both the same)."""
    base_dir = tp_model_dir if tp > 1 else base_dir
    spawn_ranks(_rank_main, (base_dir, tmp_path, tp), WORLD)
    ranked = json.loads((tmp_path / "out.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels
    try:
        one, weights = _script(TenantPolicy(load_model(base_dir)))
    finally:
        torch.set_num_threads(threads)
    assert len(ranked["rebuild_seconds"]) == 3 and ranked["probe"] is True and ranked["published"] is True
    for mine, theirs in zip(ranked["losses"], one["losses"], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-5)
    for mine, theirs in zip(ranked["steps"], one["steps"], strict=True):
        assert mine["applied"] and theirs["applied"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert ranked["logprobs"] == pytest.approx(one["logprobs"], rel=1e-5, abs=1e-6)
    assert ranked["steps"][-1]["grad_norm"] == ranked["steps"][-2]["grad_norm"]  # the state put back exactly
    assert_adam_weights_close(safetensors.torch.load_file(tmp_path / "lora.safetensors"), weights,
                              max(adam.learning_rate for adam in ADAM.values()))
