"""Attach a LoRA adapter to a frozen base model with PEFT, and the helpers the trainer needs.

The policy is `base + LoRA`; the reference policy is the same model with the adapter disabled, so
KL to the reference costs one extra forward and no second copy of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import peft
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from graft.config import ALL_LINEAR, module_list

ADAPTER_NAME = "default"


def _names(what: str, modules: str | Sequence[str], *, allow_all_linear: bool = False) -> str | list[str]:
    """`module_list` with the argument named in its error."""
    try:
        return module_list(modules, allow_all_linear=allow_all_linear)
    except ValueError as e:
        raise ValueError(f"{what} {e}") from None


def _matches(module_name: str, key: str) -> bool:
    """PEFT's list matching rule: the full module name, or its dotted suffix."""
    return module_name == key or module_name.endswith("." + key)


def check_target_modules(model: nn.Module, target_modules: str | Sequence[str],
                         exclude_modules: Sequence[str] = ()) -> None:
    """Fail early, naming the module, when a target or exclude names nothing in `model`.

    PEFT would silently skip a misspelled target as long as another one matched, and training would
    then run with fewer adapted layers than the user asked for.

    Raises:
        ValueError: a target matches no module, matches a module that is not `nn.Linear`, or an
            exclude matches no module.
    """
    named = dict(model.named_modules())
    linear_suffixes = sorted({n.rsplit(".", 1)[-1] for n, m in named.items() if isinstance(m, nn.Linear)})
    # An empty target list passes here: an adapter config may leave PEFT to infer the targets.
    targets = [] if target_modules == ALL_LINEAR else _names("target_modules", target_modules)
    for key in targets:
        hits = [n for n in named if _matches(n, key)]
        if not hits:
            raise ValueError(f"unknown target module {key!r}: {type(model).__name__} has no module "
                             f"named so (its linear modules: {', '.join(linear_suffixes)})")
        not_linear = [n for n in hits if not isinstance(named[n], nn.Linear | LoraLayer)]
        if not_linear:
            raise ValueError(f"target module {key!r} matches {not_linear[0]} "
                             f"({type(named[not_linear[0]]).__name__}); graft puts LoRA on nn.Linear only")
    for key in _names("exclude_modules", exclude_modules):
        if not any(_matches(n, key) for n in named):
            raise ValueError(f"unknown exclude module {key!r}: {type(model).__name__} has no module named so")


def attach_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
                target_modules: str | Sequence[str] = ALL_LINEAR,
                exclude_modules: Sequence[str] = (), seed: int | None = None) -> peft.PeftModel:
    """Wrap `model` with a trainable LoRA adapter; every base weight is frozen.

    Args:
        model: a HF causal LM. It is modified in place (PEFT swaps in LoRA layers).
        rank, alpha, dropout: the LoRA hyper-parameters (scaling = alpha / rank).
        target_modules: "all-linear" (every nn.Linear except the output head) or module names.
        exclude_modules: module names to leave without LoRA.
        seed: seeds the global RNG right before PEFT initialises lora_A, for reproducibility.

    Raises:
        ValueError: a target or exclude module does not exist (see `check_target_modules`), or
            `target_modules` is an empty list.
    """
    check_target_modules(model, target_modules, exclude_modules)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
        target_modules=_names("target_modules", target_modules, allow_all_linear=True),
        exclude_modules=_names("exclude_modules", exclude_modules) or None,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    """(module name, LoRA layer) for every adapted module, in model order."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter's trainable parameters by name (what the optimizer and the publisher see)."""
    return {n: p for n, p in model.named_parameters() if ".lora_" in n}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@contextlib.contextmanager
def adapter_disabled(model: peft.PeftModel) -> Iterator[None]:
    """Run the base model (the reference policy) through the same module tree, adapter off."""
    with model.disable_adapter():
        yield
