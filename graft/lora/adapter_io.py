"""LoRA adapters on disk in PEFT's format: `adapter_model.safetensors` + `adapter_config.json`.

What we write loads with `peft.PeftModel.from_pretrained` and in vLLM; what PEFT writes loads here.
Loading is strict: every file-level and tensor-level problem is found before any weight is copied,
so a bad adapter never leaves a model half-updated. Weights are never pickled.

Nothing here knows about process groups. On an FSDP2-sharded model the caller passes how to gather a
parameter whole (`gather=graft.parallel.dist.full_tensor`), how to lay a whole tensor out like a
parameter (`place=graft.parallel.dist.shard_like`) and whether this rank writes (`write=`); the
defaults are the single-process ones.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import peft
import safetensors
import safetensors.torch
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from graft.atomic import atomic_dir, save_safetensors
from graft.lora.attach import (
    ADAPTER_NAME,
    check_target_modules,
    lora_modules,
    lora_parameters,
)
from graft.models.loading import model_dtype

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt")
# PEFT options that change what the adapter computes and that graft's merge and vLLM do not implement.
_UNSUPPORTED = ("use_dora", "modules_to_save", "lora_bias", "layer_replication", "target_parameters")


Gather = Callable[[torch.Tensor], torch.Tensor]
"""A parameter -> its whole tensor (a collective under FSDP2)."""
Place = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(whole tensor, parameter) -> the tensor laid out like the parameter (a collective under FSDP2)."""


class AdapterError(ValueError):
    """A LoRA adapter directory that cannot be used, with the file or tensor at fault named."""


def _whole(param: torch.Tensor) -> torch.Tensor:
    """The default `Gather`: one process holds every parameter whole."""
    assert not hasattr(param, "full_tensor"), "a sharded parameter: pass gather=graft.parallel.dist.full_tensor"
    return param


def _as_is(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The default `Place`: one process holds every parameter whole."""
    assert not hasattr(param, "device_mesh"), "a sharded parameter: pass place=graft.parallel.dist.shard_like"
    return full


def peft_key(param_name: str) -> str:
    """Training parameter name -> PEFT's saved key (the adapter name segment is dropped)."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def _check_lora_model(model: nn.Module) -> None:
    """Refuse, before any collective, a model graft cannot read or write as a PEFT LoRA adapter.

    LoRA on anything but nn.Linear (PEFT can adapt nn.Embedding and convolutions) is refused rather
    than written: PEFT names those tensors by another rule (`lora_embedding_A`, no `.weight`) and saves
    the whole embedding matrix beside them, and graft's attach, merge and vLLM path are nn.Linear only,
    so such an adapter could neither be served nor merged by graft.

    Raises:
        AdapterError: `model` is not a PEFT model with a LoRA adapter named `default`, or one of its
            LoRA modules wraps something other than nn.Linear.
    """
    config = getattr(model, "peft_config", None) if isinstance(model, peft.PeftModel) else None
    if not config or ADAPTER_NAME not in config or config[ADAPTER_NAME].peft_type != peft.PeftType.LORA:
        raise AdapterError(f"{type(model).__name__} is not a PEFT model with a LoRA adapter {ADAPTER_NAME!r}: "
                           "attach one with attach_lora or load_adapter first")
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module.get_base_layer(), nn.Linear):
            raise AdapterError(f"LoRA on {name} ({type(module.get_base_layer()).__name__}): graft reads and "
                               "writes LoRA on nn.Linear modules only")


def adapter_state_dict(model: peft.PeftModel, dtype: torch.dtype | None = None, *,
                       gather: Gather = _whole) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names, gathered whole, contiguous, in `dtype`.

    Args:
        dtype: default the base model's dtype (what the engine serves).
        gather: a parameter -> its whole tensor; under FSDP2 `graft.parallel.dist.full_tensor`,
            and then EVERY rank must call this (the gather is a collective). Only LoRA tensors are
            gathered, so this moves megabytes, not the base model.

    Raises:
        AdapterError: see `_check_lora_model`.
    """
    _check_lora_model(model)
    return adapter_tensors({name: gather(param.detach()) for name, param in lora_parameters(model).items()},
                           dtype or model_dtype(model))


def adapter_tensors(lora: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Whole LoRA tensors under their training names -> the adapter file's tensors (PEFT's names,
    CPU, contiguous, `dtype`). Split from `adapter_state_dict` so that an FSDP2 run's rank 0 can
    publish the LoRA weights it gathered after the step without holding a model to read them from."""
    return {peft_key(name): tensor.to(device="cpu", dtype=dtype).contiguous() for name, tensor in lora.items()}


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter as a sync reads it from the trainer: the LoRA tensors under PEFT's names as the trainer
    holds them (its dtype, any device, not copied: read them before the next step changes them), the
    dtype its files carry (the base's, what the engine serves), and its PEFT config.

    Left unconverted so that whoever writes them converts while copying (graft.rollout.adapter_blob):
    at the Qwen2.5-0.5B shape, r16, converting first into new tensors cost 4-8 ms per sync (16.8 MiB
    of fresh memory written once), more than the copy that followed (2-core AMD EPYC)."""

    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype
    config: dict

    def converted(self) -> dict[str, torch.Tensor]:
        """The adapter file's tensors: CPU, contiguous, `dtype`."""
        return {key: tensor.to(device="cpu", dtype=self.dtype).contiguous() for key, tensor in self.tensors.items()}


def adapter_weights(lora: Mapping[str, torch.Tensor], layout: AdapterLayout) -> AdapterWeights:
    """Whole LoRA tensors under their training names (a model's, or those an FSDP2 run's rank 0
    gathered) as the `AdapterWeights` of the model `layout` describes."""
    return AdapterWeights({peft_key(name): tensor for name, tensor in lora.items()}, layout.dtype, dict(layout.config))


@dataclass(frozen=True)
class AdapterLayout:
    """What a sync reads of a LoRA model besides the tensors: its PEFT config, the dtype served, and where
    each LoRA parameter lives (training name, owning module, attribute). Fixed once LoRA is attached,
    so read once per model (`adapter_layout`): each read walks every module several times, measured
    35-70 ms per sync at the Qwen2.5-0.5B shape (24 layers, 2 cores; by name, `get_parameter`, still
    13 ms) against 20 ms for everything else a publish does."""

    config: dict
    dtype: torch.dtype
    owners: tuple[tuple[str, nn.Module, str], ...]

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """Every LoRA parameter (detached) by training name, as the model holds it now."""
        return {name: module._parameters[attr].detach() for name, module, attr in self.owners}


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, AdapterLayout] = weakref.WeakKeyDictionary()


def adapter_layout(model: peft.PeftModel) -> AdapterLayout:
    """`model`'s `AdapterLayout`, read at the first call (which checks the model, see
    `_check_lora_model`) and remembered for the model's life."""
    layout = _LAYOUTS.get(model)
    if layout is None:
        owners = tuple((name, model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                       for name in lora_parameters(model))
        layout = _LAYOUTS[model] = AdapterLayout(adapter_config_dict(model), model_dtype(model), owners)
    return layout


def _short_target_modules(model: peft.PeftModel) -> list[str] | None:
    """Leaf names (`q_proj`, ...) when they select exactly the adapted modules, else None.

    PEFT resolves "all-linear" to full module paths; the leaf names are what people and serving
    engines expect to read, and they mean the same set whenever no same-named module was left out.
    """
    inner = model.get_base_model()
    adapted = {name for name, _ in lora_modules(inner)}
    leaves = {name.rsplit(".", 1)[-1] for name in adapted}
    selected = {name for name, _ in inner.named_modules() if name.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if selected == adapted else None


def adapter_config_dict(model: peft.PeftModel, base_model_name_or_path: str | None = None) -> dict:
    """PEFT's own `LoraConfig` as JSON (so every field PEFT and vLLM read is present), for inference.

    Raises:
        AdapterError: see `_check_lora_model`.
    """
    _check_lora_model(model)
    config = model.peft_config[ADAPTER_NAME].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    config["target_modules"] = _short_target_modules(model) or config["target_modules"]
    config["inference_mode"] = True
    if base_model_name_or_path is not None:
        config["base_model_name_or_path"] = str(base_model_name_or_path)
    return config


def save_adapter(model: peft.PeftModel, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 base_model_name_or_path: str | None = None, overwrite: bool = False,
                 gather: Gather = _whole, write: bool = True) -> Path:
    """Write the adapter in PEFT format, atomically. Works on an FSDP2-sharded model.

    Args:
        dtype: dtype of the saved tensors; default the base model's dtype (what the engine serves).
        base_model_name_or_path: recorded in adapter_config.json; default the model's own.
        overwrite: replace an existing non-empty `out_dir`.
        gather, write: under FSDP2 every rank calls this with `gather=full_tensor` (see
            `adapter_state_dict`), and only the one with `write=True` (rank 0) writes.

    Raises:
        AdapterError: see `_check_lora_model`.
        ValueError: `out_dir` exists and is not empty, and `overwrite` is False.
    """
    tensors = adapter_state_dict(model, dtype, gather=gather)
    out_dir = Path(out_dir)
    if not write:
        return out_dir
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_adapter_files(tensors, adapter_config_dict(model, base_model_name_or_path), tmp)
    return out_dir


def write_adapter_files(tensors: dict[str, torch.Tensor], config: dict, out_dir: Path) -> None:
    """The two PEFT files into the existing directory `out_dir` (not atomic by itself: the caller's
    directory is, e.g. a publisher's temporary version directory). Tensors on a GPU are copied to the
    CPU here, where they are serialized (a no-op for `adapter_tensors`' results, already there)."""
    host = {key: tensor.detach().to(device="cpu") for key, tensor in tensors.items()}
    save_safetensors(host, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    _write_config(config, out_dir)


def write_adapter_blob_files(blob: bytes, config: dict, out_dir: Path) -> None:
    """The two PEFT files from an adapter already serialized as one safetensors blob (what the memory
    transports send, graft.rollout.adapter_blob): the blob is the weights file as it is."""
    (out_dir / ADAPTER_WEIGHTS).write_bytes(blob)
    _write_config(config, out_dir)


def _write_config(config: dict, out_dir: Path) -> None:
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_adapter_config(path: str | os.PathLike) -> dict:
    """The parsed adapter_config.json of a LoRA adapter graft supports.

    Raises:
        AdapterError: not a directory, no config, unreadable JSON, not LoRA, or an unsupported option.
    """
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory, so not a PEFT adapter")
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory: {ADAPTER_CONFIG} is missing")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise AdapterError(f"{config_file}: invalid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        peft_type = config.get("peft_type") if isinstance(config, dict) else None
        raise AdapterError(f"{config_file}: peft_type is {peft_type!r}, graft loads LORA adapters only")
    used = [k for k in _UNSUPPORTED if config.get(k)]
    if used:
        raise AdapterError(f"{config_file}: unsupported LoRA option(s) {', '.join(used)}")
    return config


def read_adapter_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter's tensors, checked to be readable, floating point and finite.

    Raises:
        AdapterError: missing or pickled weights file, corrupt safetensors, NaN/inf or non-float tensor.
    """
    path = Path(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = [n for n in _PICKLED_WEIGHTS if (path / n).exists()]
        if pickled:
            raise AdapterError(f"{path / pickled[0]}: pickled weights are not loaded (safetensors only); "
                               f"re-save the adapter with safe_serialization=True")
        raise AdapterError(f"{path} is not a PEFT adapter directory: {ADAPTER_WEIGHTS} is missing")
    try:
        tensors = safetensors.torch.load_file(weights)
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"corrupt safetensors file {weights}: {e}") from None
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterError(f"{weights}: tensor {key} has dtype {tensor.dtype}, expected floating point")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{weights}: tensor {key} contains NaN or infinite values")
    return tensors


def _check_hyperparameters(model: peft.PeftModel, config: dict, path: Path) -> None:
    """Same tensors with another rank/alpha would compute a different function: refuse."""
    ours = adapter_config_dict(model)
    for key in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"):
        theirs = config.get(key, ours[key])
        if theirs != ours[key] and not (isinstance(theirs, int | float) and math.isclose(theirs, ours[key])):
            raise AdapterError(f"{path / ADAPTER_CONFIG}: {key} is {theirs!r} "
                               f"but the model's adapter has {ours[key]!r}")


def _summarise(keys: set[str], limit: int = 4) -> str:
    listed = sorted(keys)
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more


def load_adapter_weights(model: peft.PeftModel, path: str | os.PathLike, *, place: Place = _as_is) -> None:
    """Copy an adapter's weights into `model`'s LoRA parameters (on whatever device they are), strictly.

    All checks run before the first copy, so on error the model is unchanged. Under FSDP2 every rank
    calls this with `place=graft.parallel.dist.shard_like` (a collective) and reads the files.

    Raises:
        AdapterError: see `read_adapter_config` and `read_adapter_tensors`; rank or alpha differ from
            the model's; a LoRA tensor is missing or unexpected; a shape differs from the module's.
    """
    path = Path(path)
    _load_checked(model, path, read_adapter_config(path), read_adapter_tensors(path), place)


def _load_checked(model: peft.PeftModel, path: Path, config: dict, tensors: dict[str, torch.Tensor],
                  place: Place) -> None:
    _check_hyperparameters(model, config, path)
    params = {peft_key(n): p for n, p in lora_parameters(model).items()}
    missing, unexpected = params.keys() - tensors.keys(), tensors.keys() - params.keys()
    if missing:
        raise AdapterError(f"{path}: missing {len(missing)} LoRA tensor(s): {_summarise(missing)}")
    if unexpected:
        raise AdapterError(f"{path}: {len(unexpected)} unexpected tensor(s) the model has no LoRA "
                           f"parameter for: {_summarise(unexpected)}")
    for key, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(params[key].shape):
            module, which = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
            raise AdapterError(f"{path}: shape mismatch for module {module} ({which}): adapter has "
                               f"{tuple(tensor.shape)}, the base model needs {tuple(params[key].shape)}")
    with torch.no_grad():
        for key, tensor in tensors.items():
            # The file's tensors are on the CPU: each goes to its parameter's device (a GPU) before it is
            # laid out and copied, so no copy mixes devices.
            param = params[key]
            param.copy_(place(tensor.to(device=param.device, dtype=param.dtype), param))


def load_adapter(base_model: nn.Module, path: str | os.PathLike, *, trainable: bool = False) -> peft.PeftModel:
    """Attach the adapter at `path` to `base_model` (its own LoRA config) and load its weights strictly.

    As `PeftModel.from_pretrained(..., is_trainable=trainable)`: not trainable, the model comes back in
    eval mode, so LoRA dropout is off and the logits are deterministic and equal PEFT's; trainable, the
    modes are left as PEFT leaves them (the new LoRA modules in training mode). On error `base_model`
    is left without LoRA layers, as it was.

    Raises:
        AdapterError: the adapter is unusable (see `load_adapter_weights`) or names a target module
            the base model lacks.
    """
    path = Path(path)
    config = read_adapter_config(path)
    tensors = read_adapter_tensors(path)  # file-level problems first, before the base model is touched
    try:
        check_target_modules(base_model, config.get("target_modules") or [], config.get("exclude_modules") or ())
    except ValueError as e:
        raise AdapterError(f"{path / ADAPTER_CONFIG}: {e}") from None
    lora_config = peft.LoraConfig.from_pretrained(str(path))
    lora_config.inference_mode = not trainable
    model = peft.get_peft_model(base_model, lora_config, adapter_name=ADAPTER_NAME)
    try:
        _load_checked(model, path, config, tensors, _as_is)
    except AdapterError:
        model.unload()
        raise
    return model if trainable else model.eval()
