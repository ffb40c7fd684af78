"""Trainer checkpoints: exact resume, rotation, no pickle, clear errors, and FSDP2 (2 CPU ranks, gloo)."""

import copy
import json
import pickle
import random
import shutil

import peft
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model
from graft.train.checkpoint import (
    ADAPTER_DIR,
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    RNG_META,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests.spawn import spawn_ranks

WORLD = 2
STATE = {"step": 3, "policy_version": 3, "data_cursor": 6}


def _batch() -> torch.Tensor:
    return torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))


def _setup(model_dir, *, rank: int = 4, seed: int = 0, reverse: bool = False):
    """A LoRA model and an AdamW with two groups (lora_A, lora_B); `reverse` lists each group backwards."""
    model = attach_lora(load_model(model_dir), rank=rank, alpha=8, target_modules="all-linear", seed=seed)
    return model, _adamw(model, reverse)


def _adamw(model, reverse: bool = False) -> torch.optim.AdamW:
    params = lora_parameters(model)
    a = [p for n, p in params.items() if ".lora_A." in n]
    b = [p for n, p in params.items() if ".lora_B." in n]
    if reverse:
        a, b = a[::-1], b[::-1]
    return torch.optim.AdamW([{"params": a}, {"params": b, "lr": 2e-2}], lr=1e-2, weight_decay=0.1)


def _train(model, optimizer, steps: int) -> None:
    batch = _batch()
    for _ in range(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(model).items()}


def _named_state(model, optimizer) -> dict[str, dict]:
    """The optimizer's per-parameter state by LoRA parameter name (independent of parameter order)."""
    return {n: optimizer.state[p] for n, p in lora_parameters(model).items() if p in optimizer.state}


def _assert_same(a, b) -> None:
    """Equal structures with tensors equal bit for bit, in the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("reverse", [False, True], ids=["same-order", "reordered-params"])
def test_resume_continues_bit_identically(tiny_model_dirs, tmp_path, reverse):
    model, optimizer = _setup(tiny_model_dirs["qwen2"])
    _train(model, optimizer, 3)
    path = save_checkpoint(tmp_path, model, optimizer, STATE, step=3)
    assert path == tmp_path / "step-000003"
    saved_state_dict, saved_named = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(_named_state(model, optimizer))
    draws = torch.rand(4), random.random()
    _train(model, optimizer, 2)
    expected = _params(model)

    model, optimizer = _setup(tiny_model_dirs["qwen2"], seed=1, reverse=reverse)  # also reseeds torch's RNG
    assert load_checkpoint(path, model, optimizer) == STATE
    assert torch.equal(torch.rand(4), draws[0]) and random.random() == draws[1]
    _assert_same(_named_state(model, optimizer), saved_named)
    if not reverse:
        _assert_same(optimizer.state_dict(), saved_state_dict)
    _train(model, optimizer, 2)
    got = _params(model)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_keep_rotates_and_latest_skips_temporary_and_incomplete_dirs(tiny_model_dirs, tmp_path):
    model, optimizer = _setup(tiny_model_dirs["qwen2"])
    _train(model, optimizer, 1)
    for step in range(1, 5):
        save_checkpoint(tmp_path, model, optimizer, {"step": step}, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    shutil.copytree(tmp_path / "step-000004", tmp_path / ".step-000009.tmp-abc123")  # a crashed save
    shutil.copytree(tmp_path / "step-000004", tmp_path / "step-000008")
    (tmp_path / "step-000008" / OPTIMIZER_TENSORS).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000004"
    for step in (5, 6):
        save_checkpoint(tmp_path, model, optimizer, {"step": step}, step=step, keep=0)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000006"
    assert {"step-000003", "step-000004", "step-000005", "step-000008"} <= {p.name for p in tmp_path.iterdir()}
    assert save_checkpoint(tmp_path / "other", model, optimizer, {}, step=7, write=False) is None
    assert latest_checkpoint(tmp_path / "other") is None and not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, model, optimizer, {"step": object()}, step=7)
    assert not (tmp_path / "step-000007").exists()


def test_checkpoint_is_safetensors_and_json_only(tiny_model_dirs, tmp_path, monkeypatch):
    model, optimizer = _setup(tiny_model_dirs["qwen2"])
    _train(model, optimizer, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    with monkeypatch.context() as patch:
        for module, name in [(torch, "save"), (torch, "load"), (pickle, "dump"), (pickle, "dumps"),
                             (pickle, "load"), (pickle, "loads")]:
            patch.setattr(module, name, refuse)
        path = save_checkpoint(tmp_path, model, optimizer, STATE, step=2)
        fresh, fresh_optimizer = _setup(tiny_model_dirs["qwen2"], seed=1)
        load_checkpoint(path, fresh, fresh_optimizer)
    files = [p for p in path.rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".safetensors", ".json") for p in files), files
    peft_model = peft.PeftModel.from_pretrained(load_model(tiny_model_dirs["qwen2"]), str(path / ADAPTER_DIR))
    assert all(torch.equal(peft_model.state_dict()[n], p) for n, p in _params(model).items())


def _corrupt(path) -> None:
    data = (path / OPTIMIZER_TENSORS).read_bytes()
    (path / OPTIMIZER_TENSORS).write_bytes(data[: len(data) // 2])


def _rename_parameter(path) -> None:
    meta = json.loads((path / OPTIMIZER_META).read_text())
    old = meta["param_groups"][0]["params"][0]
    meta["param_groups"][0]["params"][0] = old.replace("layers.0", "layers.7")
    meta["state"]["base_model.model.model.layers.7.self_attn.q_proj.lora_A.default.weight"] = meta["state"].pop(old)
    (path / OPTIMIZER_META).write_text(json.dumps(meta))


def _drop_parameter(path) -> None:
    meta = json.loads((path / OPTIMIZER_META).read_text())
    meta["state"].pop(meta["param_groups"][1]["params"].pop())
    (path / OPTIMIZER_META).write_text(json.dumps(meta))


@pytest.mark.parametrize("break_it, match", [
    (_corrupt, "optimizer.safetensors: corrupt safetensors"),
    (lambda path: (path / RNG_META).unlink(), "rng.json: missing"),
    (_rename_parameter, "names 1 parameter.*layers.7"),
    (_drop_parameter, "lacks 1 of the model's parameter"),
    ("rank 8", "r is 8 but the model's adapter has 4"),
], ids=["corrupt", "missing-file", "unknown-parameter", "missing-parameter", "other-lora-rank"])
def test_bad_checkpoint_is_one_clear_error_and_changes_nothing(tiny_model_dirs, tmp_path, break_it, match):
    model, optimizer = _setup(tiny_model_dirs["qwen2"], rank=8 if break_it == "rank 8" else 4)
    _train(model, optimizer, 1)
    path = save_checkpoint(tmp_path, model, optimizer, STATE, step=1)
    if callable(break_it):
        break_it(path)
    fresh, fresh_optimizer = _setup(tiny_model_dirs["qwen2"], seed=1)
    before, rng = _params(fresh), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, fresh, fresh_optimizer)
    after = _params(fresh)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert not fresh_optimizer.state and torch.equal(torch.get_rng_state(), rng)


def _sharded(model_dir):
    model = attach_lora(load_model(model_dir), rank=4, alpha=8, target_modules="all-linear", seed=0)
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, _adamw(model)


def _rank_main(rank: int, model_dir, root, init_file) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        # A single-process checkpoint loads into the shards; saving it again gathers the same tensors.
        model, optimizer = _sharded(model_dir)
        load_checkpoint(root / "single" / "step-000003", model, optimizer)
        states = [s for state in _named_state(model, optimizer).values() for s in state.values() if s.ndim]
        assert states and all(hasattr(s, "device_mesh") for s in states)
        assert save_checkpoint(root / "resaved", model, optimizer, STATE, step=3, write=rank == 0) == (
            root / "resaved" / "step-000003" if rank == 0 else None)
        # Training under FSDP2 and saving: the single-process run's state, gathered from the shards.
        model, optimizer = _sharded(model_dir)
        _train(model, optimizer, 3)
        save_checkpoint(root / "sharded", model, optimizer, STATE, step=3, write=rank == 0)
    finally:
        dist.destroy_process_group()


def test_fsdp2_checkpoints_load_across_world_sizes(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["qwen2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same matmul kernels, so the states compare bit for bit
    try:
        model, optimizer = _setup(model_dir)
        _train(model, optimizer, 3)
    finally:
        torch.set_num_threads(threads)
    single = save_checkpoint(tmp_path / "single", model, optimizer, STATE, step=3)
    spawn_ranks(_rank_main, (model_dir, tmp_path, tmp_path / "rendezvous"), WORLD)

    resaved = tmp_path / "resaved" / "step-000003"
    for name in (OPTIMIZER_TENSORS, f"{ADAPTER_DIR}/adapter_model.safetensors"):
        _assert_same(safetensors.torch.load_file(resaved / name), safetensors.torch.load_file(single / name))
    assert (resaved / OPTIMIZER_META).read_text() == (single / OPTIMIZER_META).read_text()

    fresh, fresh_optimizer = _setup(model_dir, seed=1)
    assert load_checkpoint(tmp_path / "sharded" / "step-000003", fresh, fresh_optimizer) == STATE
    got, expected = _named_state(fresh, fresh_optimizer), _named_state(model, optimizer)
    assert got.keys() == expected.keys()
    _assert_same(got, expected)  # the shards' gradients are averaged over identical batches: exact
    assert fresh_optimizer.param_groups[1]["lr"] == 2e-2 and fresh_optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def _assert_state_on(model, optimizer, device_type: str) -> None:
    """Parameters and per-parameter optimizer state on `device_type`; AdamW's scalar step on the CPU."""
    for name, param in lora_parameters(model).items():
        assert param.device.type == device_type, name
        for key, value in optimizer.state[param].items():
            assert value.device.type == ("cpu" if key == "step" else device_type), (name, key)


def test_a_checkpoint_resumes_onto_the_device_of_the_loading_model(tiny_model_dirs, tmp_path):
    """Saved from CPU tensors, restored into a model elsewhere (meta here: a device without data)."""
    model, optimizer = _setup(tiny_model_dirs["qwen2"])
    _train(model, optimizer, 2)
    path = save_checkpoint(tmp_path, model, optimizer, STATE, step=2)

    elsewhere, _ = _setup(tiny_model_dirs["qwen2"], seed=1)
    elsewhere.to("meta")
    optimizer = _adamw(elsewhere)
    assert load_checkpoint(path, elsewhere, optimizer) == STATE
    _assert_state_on(elsewhere, optimizer, "meta")


@pytest.mark.gpu
@pytest.mark.parametrize(("saved_on", "loaded_on"), [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoints_move_between_cpu_and_cuda_and_resume_bit_identically(tiny_model_dirs, tmp_path, saved_on,
                                                                           loaded_on):
    def on(device: str, seed: int):
        model, _ = _setup(tiny_model_dirs["qwen2"], seed=seed)
        model.to(device)
        return model, _adamw(model)

    model, optimizer = on(saved_on, 0)
    _train_on(model, optimizer, 3, saved_on)
    path = save_checkpoint(tmp_path, model, optimizer, STATE, step=3)
    written = safetensors.torch.load_file(path / OPTIMIZER_TENSORS)
    assert written and all(tensor.device.type == "cpu" for tensor in written.values())
    saved = {n: {k: v.to("cpu", copy=True) for k, v in s.items()} for n, s in _named_state(model, optimizer).items()}
    cuda_draw = torch.cuda.get_rng_state()
    _train_on(model, optimizer, 2, saved_on)
    expected = {n: p.cpu() for n, p in _params(model).items()}

    model, optimizer = on(loaded_on, 1)
    load_checkpoint(path, model, optimizer)
    _assert_state_on(model, optimizer, loaded_on)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_draw)
    _assert_same({n: {k: v.cpu() for k, v in s.items()} for n, s in _named_state(model, optimizer).items()}, saved)
    if saved_on == loaded_on:  # another device computes the next steps with other roundings
        _train_on(model, optimizer, 2, loaded_on)
        assert all(torch.equal(p.cpu(), expected[n]) for n, p in _params(model).items())


def _train_on(model, optimizer, steps: int, device: str) -> None:
    batch = _batch().to(device)
    for _ in range(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
