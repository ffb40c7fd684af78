"""One tenant of a `TenantPolicy` as a `graft.sync.source.PolicySource`: what publishing that tenant's
adapter to a server reads (`graft.tenants.serving`).

The tenants share one PEFT model, served by one model thread that runs one job at a time (`run`): a
forward of another tenant, or this tenant's next `optim_step`, may be running when a publish of this
tenant starts or when its delivery check reads the trainer's log-probs. So every read of the model
is a job handed to `run`, and the source is a snapshot: the tenant's LoRA values are copied at the
first job (the version is what the adapter was when its publish reached the model thread), and each
later job runs with those values copied into the tenant's adapter and the live ones copied back
after it (bit-exact both ways; optimizer state and gradients untouched), as
`graft.sync.source.SnapshotSource` does for a one-adapter model. Without it, a tenant that steps
again right after asking for a version would fail that version's delivery check (the server
serves the version, the trainer's side would read the next one).

What it publishes is what a one-adapter PEFT file of that tenant holds: tensor keys without the
adapter name (`...q_proj.lora_A.weight`, as `peft_key` makes them for PEFT's "default"), the base's
dtype, and the tenant's own `LoraConfig` (its rank, alpha and target modules, not the union of all
tenants' modules) in `adapter_config_dict`'s form.

Not a `ModelSource`: the delivery check's diagnosis (`graft.sync.verify.likely_cause`) varies a
one-adapter model's "default" adapter, which this model does not have; a failed check here reports
the gap without a suspect.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import peft
import torch
from peft.tuners.lora import LoraLayer

from graft.host import one_thread_fewer
from graft.lora.adapter_io import AdapterWeights
from graft.lora.routing import routed
from graft.models.loading import model_dtype
from graft.sync.source import probe_logits_finite, swapped_in
from graft.tenants.policy import TenantPolicy

T = TypeVar("T")


def tenant_config_dict(model: peft.PeftModel, tenant: str) -> dict:
    """`tenant`'s PEFT `LoraConfig` as `graft.lora.adapter_io.adapter_config_dict` writes a one-adapter
    model's: every field, sets as sorted lists, target modules as leaf names when they select exactly
    the tenant's adapted modules, inference mode on."""
    config = model.peft_config[tenant].to_dict()
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    inner = model.get_base_model()
    adapted = {name for name, module in inner.named_modules() if isinstance(module, LoraLayer)
               and tenant in module.lora_A}
    leaves = {name.rsplit(".", 1)[-1] for name in adapted}
    selected = {name for name, _ in inner.named_modules() if name.rsplit(".", 1)[-1] in leaves}
    if selected == adapted:
        config["target_modules"] = sorted(leaves)
    config["inference_mode"] = True
    # PEFT records the base only in the first adapter's config (get_peft_model), not in add_adapter's.
    config["base_model_name_or_path"] = config.get("base_model_name_or_path") or getattr(inner, "name_or_path", None)
    return config


def single_adapter_key(param_name: str, tenant: str) -> str:
    """`...q_proj.lora_A.<tenant>.weight` -> `...q_proj.lora_A.weight`: the key a one-adapter PEFT file
    holds. Only the segment after lora_A/lora_B is dropped, so a tenant named like a module path
    segment ("0", "mlp") leaves the path intact."""
    for kind in ("lora_A", "lora_B"):
        param_name = param_name.replace(f".{kind}.{tenant}.", f".{kind}.")
    return param_name


class TenantSource:
    """`tenant` of `policy` as a `PolicySource` (module docstring). `run(fn)` runs `fn` on the thread
    that owns the model, one job at a time, and returns its result."""

    def __init__(self, policy: TenantPolicy, tenant: str, run: Callable[[Callable[[], T]], Awaitable[T]]) -> None:
        if tenant not in policy.tenants:
            raise ValueError(f"unknown tenant {tenant!r} (tenants: {', '.join(policy.tenants) or 'none'})")
        self.model = policy.model
        self.tenant = tenant
        self._policy = policy
        self._run = run
        self._published: dict[str, torch.Tensor] | None = None  # the snapshot, by training name
        self._published_as: tuple[torch.dtype, dict] | None = None  # its dtype and LoraConfig

    def _live(self) -> dict[str, torch.Tensor]:
        return {name: param.detach() for name, param in self._policy.parameters(self.tenant).items()}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The published values, copied now if no job took them yet (a caller outside the model thread
        then must know that nothing changes the adapter meanwhile, e.g. a test). The model's dtype and
        the tenant's config are read with them: walking the model's modules from the event loop while
        the model thread removed a finished tenant's failed a publish ("dictionary changed size during
        iteration", 8 cookbook clients)."""
        if self._published is None:
            self._published = {name: tensor.clone() for name, tensor in self._live().items()}
            self._published_as = (model_dtype(self.model), tenant_config_dict(self.model, self.tenant))
        return self._published

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """The tenant's LoRA tensors as published, by PEFT training name (`...lora_A.<tenant>.weight`)."""
        return dict(self._snapshot())

    def adapter(self) -> AdapterWeights:
        tensors = {single_adapter_key(name, self.tenant): tensor for name, tensor in self._snapshot().items()}
        return AdapterWeights(tensors, *self._published_as)

    def merged_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError("tenants share one base: each is served as an adapter, never merged into it")

    def logprobs(self, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """Teacher-forced log-probs under the tenant's adapter; call inside `read` (the model thread)."""
        return self._policy.logprobs(self.tenant, prompt, completion)

    def probe_logits_finite(self, probe: Sequence[int]) -> bool:
        """Whether the tenant's logits over `probe` are finite; call inside `read` (the model thread)."""
        with routed(self.model, torch.zeros((1, len(probe)), dtype=torch.long), [self.tenant]):
            return probe_logits_finite(self.model, probe)

    async def read(self, read: Callable[[], T]) -> T:
        return await self._run(functools.partial(self._as_published, read))

    def _as_published(self, read: Callable[[], T]) -> T:
        """`read()` with the tenant's adapter holding the published values, its live values after."""
        published = self._snapshot()
        # publishing's reads are a few short forwards, run while vLLM samples other tenants
        with swapped_in(self._live(), published), one_thread_fewer():
            return read()
