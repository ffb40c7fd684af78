"""Saving the adapter from an FSDP2-sharded model (2 CPU ranks, gloo) gives the single-process files."""

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from graft.lora.adapter_io import ADAPTER_WEIGHTS, load_adapter_weights, save_adapter
from graft.lora.attach import lora_parameters
from graft.parallel.dist import full_tensor, shard_like
from tests.helpers import trained_like_peft_model
from tests.spawn import spawn_ranks

WORLD = 2


def _rank_main(rank: int, model_dir, out_dir, init_file) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = trained_like_peft_model(model_dir)
        for layer in model.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert any(hasattr(p, "full_tensor") for p in lora_parameters(model).values())
        save_adapter(model, out_dir / "sharded", gather=full_tensor, write=rank == 0)
        dist.barrier()
        # Loading back into the sharded model distributes each tensor to its shard.
        reloaded = trained_like_peft_model(model_dir, seed=99)
        for layer in reloaded.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(reloaded)
        load_adapter_weights(reloaded, out_dir / "sharded", place=shard_like)
        save_adapter(reloaded, out_dir / "reloaded", gather=full_tensor, write=rank == 0)
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_save_equals_single_process_save(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["qwen2"]
    spawn_ranks(_rank_main, (model_dir, tmp_path, tmp_path / "rendezvous"), WORLD)
    save_adapter(trained_like_peft_model(model_dir), tmp_path / "single")
    single = safetensors.torch.load_file(tmp_path / "single" / ADAPTER_WEIGHTS)
    for name in ("sharded", "reloaded"):
        got = safetensors.torch.load_file(tmp_path / name / ADAPTER_WEIGHTS)
        assert got.keys() == single.keys()
        assert all(torch.equal(got[k], single[k]) for k in single), name
