"""A tenant's training state on disk: its adapter as a PEFT directory, plus its optimizer.

What the Tinker API's `save_state` writes and `load_state` / `create_training_client_from_state`
read. The directory is a plain PEFT adapter (`adapter_model.safetensors`, `adapter_config.json`:
`peft.PeftModel.from_pretrained` and vLLM load it as it is) with `optimizer.safetensors` beside it:
each LoRA tensor's AdamW moments and step count under `<PEFT key>.<exp_avg|exp_avg_sq|step>`, so
that training resumes exactly (the next step equals the one an uninterrupted run takes). Nothing is
pickled.

A save killed at any instant leaves the previous complete state at the path or the new one, never a
half-written one, and never nothing once a save has finished: the state is filled in a hidden
sibling `.<name>.tmp-*`, fsynced, and exchanged with the old one in one step (graft.atomic.atomic_dir;
Linux `renameat2`, where graft.atomic documents its fallback). The hidden siblings killed saves leave
are removed by `graft.atomic.sweep_temporaries` at the service's start. Tested with real processes
SIGKILLed mid-save in tests/tenants/test_checkpoint_crash.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from graft.atomic import atomic_dir, save_safetensors
from graft.lora.adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_adapter_files
from graft.tenants.policy import TenantPolicy, TenantSpec, TenantState
from graft.tenants.source import single_adapter_key, tenant_config_dict

OPTIMIZER = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq", "step")


class TenantCheckpointError(ValueError):
    """A tenant checkpoint that is missing, incomplete, or of another adapter shape."""


def save_tenant(policy: TenantPolicy, tenant: str, out_dir: Path, *, overwrite: bool = False) -> Path:
    """Write `tenant`'s adapter (fp32, as trained) and optimizer state to `out_dir`; run it where the
    model is not being changed (the service's model thread). With `overwrite`, an existing state is
    replaced in one step: a crash leaves the old state or the new one at `out_dir`.

    Raises:
        ValueError: `out_dir` holds files and `overwrite` is False.
    """
    state = policy.tenant_state(tenant)  # on a sharded policy: whole tensors, gathered on every rank
    moments = {}
    for name, saved in state.moments.items():
        for moment, value in saved.items():
            moments[f"{single_adapter_key(name, tenant)}.{moment}"] = torch.as_tensor(value).detach().cpu()
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        write_adapter_files({single_adapter_key(name, tenant): tensor for name, tensor in state.params.items()},
                            tenant_config_dict(policy.model, tenant), tmp)
        save_safetensors(moments, tmp / OPTIMIZER)
    return out_dir


def tenant_spec(path: Path, name: str, seed: int = 0) -> TenantSpec:
    """The `TenantSpec` of the adapter saved at `path`, for a tenant called `name`."""
    config = _config(path)
    modules = config["target_modules"]
    return TenantSpec(name, rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      target_modules=tuple(modules) if isinstance(modules, list) else modules, seed=seed)


def load_tenant(policy: TenantPolicy, tenant: str, path: Path, *, with_optimizer: bool) -> None:
    """Copy the adapter (and, `with_optimizer`, the AdamW state) saved at `path` into `tenant`.

    Raises:
        TenantCheckpointError: files missing, or tensors that do not match the tenant's adapter.
    """
    params = policy.parameters(tenant)
    saved = _tensors(path / ADAPTER_WEIGHTS)
    keys = {single_adapter_key(name, tenant): name for name in params}
    if set(saved) != set(keys) or any(saved[key].shape != params[keys[key]].shape for key in keys):
        raise TenantCheckpointError(f"{path}: its tensors do not match tenant {tenant!r}'s adapter (rank or modules "
                                    "differ)")
    moments = _tensors(path / OPTIMIZER) if with_optimizer else {}
    policy.set_tenant_state(tenant, TenantState(
        {name: saved[key] for key, name in keys.items()}, {name: None for name in keys.values()},
        {name: {m: moments[f"{key}.{m}"] for m in MOMENTS if f"{key}.{m}" in moments} for key, name in keys.items()}))


def _config(path: Path) -> dict:
    try:
        return json.loads((path / ADAPTER_CONFIG).read_text())
    except FileNotFoundError as error:
        raise TenantCheckpointError(f"no tenant checkpoint at {path} ({ADAPTER_CONFIG} is missing)") from error


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise TenantCheckpointError(f"{file} is missing: not a complete tenant checkpoint")
    return safetensors.torch.load_file(file)
