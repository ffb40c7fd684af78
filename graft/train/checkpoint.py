"""Resumable trainer state: RUN_DIR/checkpoints/step-000007/, for an exact resume, with no pickle anywhere.

A checkpoint directory holds:
    adapter/                 the LoRA adapter in PEFT's format, fp32 (loads with `PeftModel.from_pretrained`)
    optimizer.safetensors    every optimizer tensor (per-parameter state, tensor hyper-parameters)
    optimizer.json           param_groups hyper-parameters and per-parameter state, keyed by the LoRA
                             parameter's NAME (not its index, which changes with the parameter order)
    rng.safetensors          torch CPU and CUDA generator states
    rng.json                 python `random` state
    trainer_state.json       the trainer's own counters (step, policy_version, data cursor, ...)

Tensors go to safetensors and everything else to JSON, so loading a checkpoint never runs code from
the file. Tensors are written from CPU copies (the model may be on a GPU) and loaded back onto the
device of the parameter they belong to, whichever device saved them. Directories are written
through `atomic_dir`, so a crash leaves either the previous checkpoint set or the new one;
`latest_checkpoint` also skips temporary and incomplete directories.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import peft
import safetensors
import safetensors.torch
import torch

from graft.atomic import atomic_dir, save_safetensors
from graft.lora.adapter_io import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    adapter_config_dict,
    adapter_state_dict,
    load_adapter_weights,
    read_adapter_config,
    write_adapter_files,
)
from graft.lora.attach import lora_parameters
from graft.parallel.dist import full_tensor, shard_like

CHECKPOINT_PREFIX = "step-"
ADAPTER_DIR = "adapter"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
RNG_TENSORS = "rng.safetensors"
RNG_META = "rng.json"
TRAINER_STATE = "trainer_state.json"
# What a resume needs from trainer_state.json (the trainer writes these; it may write more).
TRAINER_STATE_KEYS = ("step", "policy_version")
CHECKPOINT_FILES = (f"{ADAPTER_DIR}/{ADAPTER_CONFIG}", f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}", OPTIMIZER_TENSORS,
                    OPTIMIZER_META, RNG_TENSORS, RNG_META, TRAINER_STATE)
# LoRA options that change the adapter's parameters or the function they compute.
_LORA_KEYS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules")
_STEP_DIR = re.compile(re.escape(CHECKPOINT_PREFIX) + r"(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this model and optimizer, with the file at fault named."""


def save_checkpoint(checkpoints_dir: Path, model: peft.PeftModel, optimizer: torch.optim.Optimizer,
                    trainer_state: dict, *, step: int, keep: int = 2, write: bool = True) -> Path | None:
    """Write `checkpoints_dir/step-{step:06d}/` atomically, then drop older checkpoints beyond `keep`.

    Args:
        trainer_state: the trainer's counters; must be JSON-serialisable (comes back with JSON types).
        step: the GRPO step the state is at; names the directory. Re-saving a step replaces it.
        keep: how many checkpoints to keep, this one included; 0 keeps all.
        write: whether this rank writes. Under FSDP2 gathering the adapter and the optimizer state is
            a collective, so EVERY rank must call this; only the writer (rank 0) writes, and its RNG
            state is the one saved.

    Returns:
        The checkpoint directory on the writer, None elsewhere.

    Raises:
        ValueError: `trainer_state` is not JSON-serialisable, the optimizer holds a parameter that is not
            a LoRA parameter of `model`, or an optimizer value has a type we cannot store.
    """
    if step < 0 or keep < 0:
        raise ValueError(f"step and keep must be >= 0, got step={step}, keep={keep}")
    try:  # before the collectives, so every rank fails alike
        trainer_json = json.dumps(trainer_state, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"trainer_state is not JSON-serialisable: {e}") from None
    # fp32 even on a bf16 base: resume must be exact
    adapter = adapter_state_dict(model, torch.float32, gather=full_tensor)
    optimizer_meta, optimizer_tensors = _optimizer_files(model, optimizer)
    if not write:
        return None
    rng_meta, rng_tensors = _rng_files()
    target = Path(checkpoints_dir) / f"{CHECKPOINT_PREFIX}{step:06d}"
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / ADAPTER_DIR).mkdir()
        write_adapter_files(adapter, adapter_config_dict(model), tmp / ADAPTER_DIR)
        save_safetensors(optimizer_tensors, tmp / OPTIMIZER_TENSORS)
        (tmp / OPTIMIZER_META).write_text(json.dumps(optimizer_meta, indent=1) + "\n")
        save_safetensors(rng_tensors, tmp / RNG_TENSORS)
        (tmp / RNG_META).write_text(json.dumps(rng_meta) + "\n")
        (tmp / TRAINER_STATE).write_text(trainer_json)
    _rotate(target.parent, step, keep)
    return target


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Checkpoints with every file present, highest step first. Temporary (`.step-*.tmp-*`)
    directories and directories missing any checkpoint file are skipped."""
    complete = [(step, path) for step, path in _step_dirs(Path(checkpoints_dir))
                if all((path / name).is_file() for name in CHECKPOINT_FILES)]
    return [path for _, path in sorted(complete, reverse=True)]


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = complete_checkpoints(checkpoints_dir)
    return found[0] if found else None


def load_checkpoint(path: Path, model: peft.PeftModel, optimizer: torch.optim.Optimizer) -> dict:
    """Restore adapter weights, optimizer state and RNG states from `path`; return the trainer state.

    Every file is read and checked against `model` and `optimizer` before anything is changed, so a bad
    checkpoint leaves both as they were. Under FSDP2 every rank calls this and reads the files; full
    tensors are distributed to each rank's shard (a collective) and every rank gets the writer's RNG.

    Raises:
        CheckpointError: a missing file, corrupt safetensors or JSON, a checkpoint of a different LoRA
            config or optimizer class, or optimizer state for parameters the model lacks (or lacking
            parameters the model has).
    """
    path = Path(path)
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path / missing[0]}: missing, so {path} is not a complete checkpoint")
    _check_lora_config(model, path / ADAPTER_DIR)
    trainer_state = _read_json(path / TRAINER_STATE)
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"{path / TRAINER_STATE}: expected a JSON object, got {type(trainer_state).__name__}")
    lacking = [k for k in TRAINER_STATE_KEYS if not isinstance(trainer_state.get(k), int)]
    if lacking:
        raise CheckpointError(f"{path / TRAINER_STATE}: no integer {', '.join(lacking)}")
    rng = _read_rng(path)
    optimizer_state = _read_optimizer(path, model, optimizer)
    try:
        # strict: checks everything before the first copy
        load_adapter_weights(model, path / ADAPTER_DIR, place=shard_like)
    except AdapterError as e:
        raise CheckpointError(str(e)) from None
    optimizer.load_state_dict(optimizer_state)
    _set_rng(*rng)
    return trainer_state


# --- optimizer ---------------------------------------------------------------------------------------

def _param_names(model: peft.PeftModel, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(parameter) -> LoRA parameter name, for every parameter the optimizer holds."""
    names = {id(param): name for name, param in lora_parameters(model).items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not a "
                                 "LoRA parameter of the model; graft checkpoints LoRA-only optimizers")
    return names


def _optimizer_files(model: peft.PeftModel, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(optimizer.json content, optimizer.safetensors tensors), gathered whole: a collective on DTensors."""
    names = _param_names(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    groups, state = [], {}
    for i, group in enumerate(optimizer.param_groups):
        meta = {key: _encode(value, f"param_groups/{i}/{key}", tensors) for key, value in group.items()
                if key != "params"}
        groups.append({**meta, "params": [names[id(param)] for param in group["params"]]})
        for param in group["params"]:
            if param in optimizer.state:  # a parameter that never had a gradient has no state
                name = names[id(param)]
                for key, value in optimizer.state[param].items():
                    if isinstance(value, torch.Tensor) and value.ndim and value.shape != param.shape:
                        raise ValueError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither "
                                         f"a scalar nor the parameter's {tuple(param.shape)}: cannot be resharded")
                state[name] = {key: _encode(value, f"state/{name}/{key}", tensors)
                               for key, value in optimizer.state[param].items()}
    return {"optimizer": type(optimizer).__name__, "param_groups": groups, "state": state}, tensors


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON value for `value`; tensors go to `tensors[key]` and leave {"tensor": key}, tuples {"tuple": [...]}."""
    if isinstance(value, torch.Tensor):  # on the parameter's device (a GPU): safetensors writes host memory
        value = value.detach()
        tensors[key] = full_tensor(value).to(device="cpu").contiguous()
        return {"tensor": key}
    if isinstance(value, tuple):  # e.g. AdamW's betas: restored as a tuple so state_dict() compares equal
        return {"tuple": [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"cannot checkpoint optimizer value {key} of type {type(value).__name__}")


def _decode(value: Any, tensors: dict[str, torch.Tensor], file: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, file) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"tuple"}:
        return tuple(_decode(v, tensors, file) for v in value["tuple"])
    if value.keys() == {"tensor"}:
        if value["tensor"] not in tensors:
            raise CheckpointError(f"{file.with_name(OPTIMIZER_TENSORS)}: tensor {value['tensor']} is missing")
        return tensors[value["tensor"]]
    raise CheckpointError(f"{file}: unknown value {value!r}")


def _read_optimizer(path: Path, model: peft.PeftModel, optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint's optimizer state in `optimizer.state_dict()` form: parameter names mapped to this
    optimizer's indices, tensors of sharded parameters distributed like them."""
    file = path / OPTIMIZER_META
    meta = _read_json(file)
    tensors = _read_safetensors(path / OPTIMIZER_TENSORS)
    if not isinstance(meta, dict) or not {"optimizer", "param_groups", "state"} <= meta.keys():
        raise CheckpointError(f"{file}: not an optimizer checkpoint (needs optimizer, param_groups and state)")
    if meta["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"{file}: saved from {meta['optimizer']}, cannot restore into {type(optimizer).__name__}")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{file}: {len(meta['param_groups'])} parameter group(s), the optimizer has "
                              f"{len(optimizer.param_groups)}")
    names, params = _param_names(model, optimizer), lora_parameters(model)
    index: dict[str, int] = {}  # name -> index in state_dict()'s numbering: groups in order, params in order
    groups = []
    for i, (saved, group) in enumerate(zip(meta["param_groups"], optimizer.param_groups)):
        ours = [names[id(param)] for param in group["params"]]
        _check_same_names(set(saved.get("params", [])), set(ours), f"{file}: parameter group {i}")
        index.update({name: len(index) + j for j, name in enumerate(ours)})
        hyper = {key: _decode(value, tensors, file) for key, value in saved.items() if key != "params"}
        groups.append({**hyper, "params": [index[name] for name in ours]})
    _check_same_names(set(meta["state"]) | index.keys(), index.keys(), f"{file}: state")  # state is optional
    state = {index[name]: {key: _placed(_decode(value, tensors, file), params[name], f"{file}: {key!r} of {name}")
                           for key, value in entries.items()}
             for name, entries in meta["state"].items()}
    return {"state": state, "param_groups": groups}


def _check_same_names(saved: set[str], ours: set[str], where: str) -> None:
    if saved - ours:
        raise CheckpointError(f"{where} names {len(saved - ours)} parameter(s) the model does not have, e.g. "
                              f"{min(saved - ours)} (a checkpoint of another model or LoRA config?)")
    if ours - saved:
        raise CheckpointError(f"{where} lacks {len(ours - saved)} of the model's parameter(s), "
                              f"e.g. {min(ours - saved)}")


def _placed(value: Any, param: torch.Tensor, where: str) -> Any:
    """A full state tensor shaped like `param`, on its device (the file's tensors are on the CPU, the
    parameter on a GPU when there is one), sharded like it when it is a DTensor (a collective).

    Scalars stay where they are: AdamW's `step` lives on the CPU unless the optimizer is fused or
    capturable, and `Optimizer.load_state_dict` moves it to the parameter's device in exactly those cases.
    """
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    if value.shape != param.shape:
        raise CheckpointError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")
    return shard_like(value.to(device=param.device), param)


# --- LoRA config, files ------------------------------------------------------------------------------

def _check_lora_config(model: peft.PeftModel, adapter_dir: Path) -> None:
    """Same-named tensors under another rank, alpha or target set would resume a different run: refuse early."""
    try:
        saved = read_adapter_config(adapter_dir)
    except AdapterError as e:
        raise CheckpointError(str(e)) from None
    ours = adapter_config_dict(model)
    for key in _LORA_KEYS:
        if saved.get(key) != ours.get(key):
            raise CheckpointError(f"{adapter_dir / ADAPTER_CONFIG}: {key} is {saved.get(key)!r} but the model's "
                                  f"adapter has {ours.get(key)!r}: a checkpoint of a different LoRA config")


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable JSON ({e})") from None


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(file)
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors file ({e})") from None


def _step_dirs(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    if not checkpoints_dir.is_dir():
        return []
    matches = ((_STEP_DIR.fullmatch(p.name), p) for p in checkpoints_dir.iterdir() if p.is_dir())
    return [(int(m.group(1)), p) for m, p in matches if m]


def _rotate(checkpoints_dir: Path, step: int, keep: int) -> None:
    """Keep the `keep` newest checkpoints up to `step`; later ones (another timeline) are not ours to judge."""
    if keep == 0:
        return
    older = sorted(item for item in _step_dirs(checkpoints_dir) if item[0] < step)
    for _, path in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(path)


# --- RNG ---------------------------------------------------------------------------------------------

def _rng_files() -> tuple[dict, dict[str, torch.Tensor]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda/{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss_next = random.getstate()
    return {"python_random": [version, list(internal), gauss_next]}, tensors


def _read_rng(path: Path) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    """(torch CPU state, CUDA states, python state), checked so that setting them cannot fail halfway."""
    tensors = _read_safetensors(path / RNG_TENSORS)
    cpu = tensors.get("torch_cpu")
    if cpu is None or cpu.dtype != torch.uint8 or cpu.shape != torch.get_rng_state().shape:
        raise CheckpointError(f"{path / RNG_TENSORS}: no valid torch_cpu generator state")
    cuda = [tensors[f"cuda/{i}"] for i in range(len(tensors)) if f"cuda/{i}" in tensors]
    if any(state.dtype != torch.uint8 or state.ndim != 1 for state in cuda):
        raise CheckpointError(f"{path / RNG_TENSORS}: a cuda/N generator state is not a 1-D uint8 tensor")
    meta = _read_json(path / RNG_META)
    try:
        version, internal, gauss_next = meta["python_random"]
        python_state = (version, tuple(internal), gauss_next)
        random.Random().setstate(python_state)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / RNG_META}: invalid python_random state ({e!r})") from None
    return cpu, cuda, python_state


def _set_rng(cpu: torch.Tensor, cuda: list[torch.Tensor], python_state: tuple) -> None:
    torch.set_rng_state(cpu)
    if torch.cuda.is_available():  # a resume on fewer GPUs restores the ones it has
        for i, state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
    random.setstate(python_state)
