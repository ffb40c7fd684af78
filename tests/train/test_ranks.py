"""An FSDP2 run's rank 0 publishes and verifies without a copy of the model (`ShardedSource`, the other
rank following its announced collectives): on 2 CPU ranks (gloo) the published adapter files and
merged weights are a one-process run's byte for byte, delivery verification measures the same gap on
the sharded model, and rank 0 holds its shard and the LoRA tensors, never a whole model."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.parallel.dist import Dist, full_tensor
from graft.parallel.parallelize import apply_fsdp
from graft.rollout.reference import ReferenceEngine
from graft.sync.policy_sync import PolicySync
from graft.sync.source import policy_source
from graft.sync.verify import verify_delivery
from graft.train.policy import PolicyState
from graft.train.ranks import Op, ShardedSource, announce, follow
from tests.helpers import trained_like_peft_model
from tests.spawn import spawn_ranks

WORLD = 2
MODES = ("adapter", "merged")


async def _publish_and_verify(policy, model_dir, out_dir: Path) -> dict:
    """Rank 0 or the one process: version 1 through each mode's `PolicySync` (guard, publish,
    verify), the merged stream in bfloat16, and the gap against an engine still serving the base
    model (a failed delivery: measured, not raised)."""
    rows = {}
    for mode in MODES:
        config = load_config(None, [f"model.path={model_dir}", "rollout.engine=reference", "lora.name=p",
                                    f"sync.mode={mode}"])
        sync = PolicySync(config, ReferenceEngine(model_dir), out_dir / mode)
        rows[mode] = await sync(policy, 1, step=1)
        await sync.close()
    bf16 = dict(policy_source(policy).merged_weights(torch.bfloat16))
    safetensors.torch.save_file(bf16, out_dir / "bf16.safetensors")
    rows["base_gap"] = await verify_delivery(ReferenceEngine(model_dir), policy, adapter=None, tolerance=1e-3,
                                             warn_only=True)
    return rows


def _reachable_tensor_bytes(root) -> int:
    """Bytes of the tensors reachable from `root`: modules' parameters and buffers as this rank stores
    them (its shard), the optimizer's state, dicts, lists and graft objects; each storage once."""
    seen_storage, visited, stack, total = set(), set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen_storage:
                seen_storage.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, nn.Module):
            stack += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [t for state in obj.state.values() for t in state.values()]
        elif isinstance(obj, dict):
            stack += obj.values()
        elif isinstance(obj, list | tuple):
            stack += obj
        elif type(obj).__module__.startswith("graft."):
            stack += vars(obj).values()
    return total


def _policy_state_bytes(model_dir, run_dir: Path, ctx: Dist) -> dict:
    """What a fresh `PolicyState` keeps on this rank, against the whole model's and LoRA's sizes."""
    config = load_config(None, [f"model.path={model_dir}", "lora.rank=4", "model.dtype=float32"])
    policy = PolicyState(config, run_dir, ctx, pad_id=0, resume=False)
    whole = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    lora = sum(p.numel() * p.element_size() for p in lora_parameters(policy.model).values())
    return {"reachable": _reachable_tensor_bytes(policy), "whole_model": whole, "lora": lora}


def _rank_main(rank: int, model_dir, out_dir: Path, init_file) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    ctx = Dist(rank, WORLD)
    try:
        model = apply_fsdp(trained_like_peft_model(model_dir), ctx)
        lora = {name: full_tensor(p.detach()) for name, p in lora_parameters(model).items()}  # as after a step
        if rank == 0:
            rows = asyncio.run(_publish_and_verify(ShardedSource(model, lora), model_dir, out_dir))
            announce(Op.STOP)
        else:  # the sync's reads only: no policy to learn or checkpoint with
            follow(SimpleNamespace(ctx=ctx, model=model))
        sizes = _policy_state_bytes(model_dir, out_dir / f"run-{rank}", ctx)
        if rank == 0:
            (out_dir / "rows.json").write_text(json.dumps({**rows, "sizes": sizes}))
    finally:
        dist.destroy_process_group()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_rank_zero_publishes_and_verifies_the_one_process_bytes_without_a_model_copy(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["qwen2"]
    (tmp_path / "sharded").mkdir()
    spawn_ranks(_rank_main, (model_dir, tmp_path / "sharded", tmp_path / "rendezvous"), WORLD)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: same kernels, same rounding
    try:
        (tmp_path / "one").mkdir()
        one = asyncio.run(_publish_and_verify(trained_like_peft_model(model_dir), model_dir, tmp_path / "one"))
    finally:
        torch.set_num_threads(threads)
    sharded = json.loads((tmp_path / "sharded" / "rows.json").read_text())

    for mode in MODES:
        kind_dir = f"{mode}/weights/{mode}-v000001"
        expected = _files(tmp_path / "one" / kind_dir)
        assert expected and _files(tmp_path / "sharded" / kind_dir) == expected, mode  # byte for byte
        assert sharded[mode]["sync_bytes"] == one[mode]["sync_bytes"]
        gap = "sync_logprob_abs_diff_max"
        assert sharded[mode][gap] == pytest.approx(one[mode][gap], abs=1e-6)
    bf16 = "bf16.safetensors"
    assert (tmp_path / "sharded" / bf16).read_bytes() == (tmp_path / "one" / bf16).read_bytes()
    # A delivery that failed (the engine serves the base): the sharded forward measures the same gap.
    assert one["base_gap"] > 0.01
    assert sharded["base_gap"] == pytest.approx(one["base_gap"], rel=1e-5)

    sizes = sharded["sizes"]  # rank 0: its half of the model and the gathered LoRA tensors, no whole copy
    assert sizes["reachable"] < 0.5 * sizes["whole_model"] + sizes["lora"] + 64 * 1024, sizes
