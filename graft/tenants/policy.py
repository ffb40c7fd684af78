"""Many tenants' LoRA adapters on one frozen base, trained in shared batches: `TenantPolicy`.

Each tenant is a PEFT adapter of its own (rank, alpha, target modules, initialisation seed) on the
same base model, with its own optimizer. `forward_backward` takes datums of any tenants, runs them
as one padded batch through the base once, each token's LoRA delta from its tenant's adapter
(graft.lora.routing), and accumulates each tenant's gradients from its own datums' losses only;
`optim_step(tenant, ...)` then steps that tenant alone. This is the Tinker API's training model
(forward_backward accumulates, optim_step applies) with the batch shared across tenants.

Isolation: a tenant's adapter after any sequence of calls equals the same tenant trained alone on the
same datums, whatever the others did; a tenant whose gradients are not finite is refused its step
alone. Losses are sums over positions (graft.tenants.losses), so no datum's weight depends on the
others in its batch. How equal: by default up to float rounding (1e-6 relative, fp32), as the base's
kernels round by the batch's shape; with `batch_invariant` bit for bit (graft.tenants.invariant: the
base's GEMMs in fixed row blocks, attention per row, and each tenant's datums cut into passes as they
would be alone, `invariant_passes`).

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import peft
import torch
from torch import nn

from graft.config import ALL_LINEAR
from graft.host import host_memory_mode, update_memory_cached
from graft.lora.routing import BASE_ONLY, routed
from graft.rl.logprobs import sequence_logprobs, teacher_forced_logprobs
from graft.sync.source import eval_mode
from graft.tenants.invariant import batch_invariant
from graft.tenants.losses import LOSSES, LossConfigError, loss_config
from graft.tenants.users import PASS_TOKENS


def passes_of(datums: Sequence[Datum], budget: int) -> Iterator[list[Datum]]:
    """`datums` in order, cut into runs whose padded size (rows x longest) stays within `budget`
    (a longer datum alone is a run of its own)."""
    chunk: list[Datum] = []
    longest = 0
    for datum in datums:
        longest_with = max(longest, len(datum.tokens))
        if chunk and longest_with * (len(chunk) + 1) > budget:
            yield chunk
            chunk, longest_with = [], len(datum.tokens)
        chunk.append(datum)
        longest = longest_with
    if chunk:
        yield chunk


def invariant_passes(datums: Sequence[Datum], budget: int) -> list[list[int]]:
    """Indices into `datums`, cut into passes so that each tenant's datums are cut as they would be
    alone: each tenant's own (in order) cut by `passes_of`, then whole pieces packed into passes within
    `budget` (a pass sums a tenant's gradient over the tokens it holds: the same pieces, the same sums)."""
    indices_of: dict[str, list[int]] = {}
    for index, datum in enumerate(datums):
        indices_of.setdefault(datum.tenant, []).append(index)
    pieces = []
    for indices in indices_of.values():
        for chunk in passes_of([datums[i] for i in indices], budget):
            pieces.append(indices[:len(chunk)])
            indices = indices[len(chunk):]
    passes: list[list[int]] = []
    longest = 0  # the longest datum of the last pass
    for piece in pieces:
        piece_longest = max(len(datums[i].tokens) for i in piece)
        if passes and (len(passes[-1]) + len(piece)) * max(longest, piece_longest) <= budget:
            passes[-1] += piece
            longest = max(longest, piece_longest)
        else:
            passes.append(list(piece))
            longest = piece_longest
    return passes


class TenantError(ValueError):
    """A request that names an unknown tenant, an unknown loss, or malformed datums."""


@dataclass(frozen=True)
class TenantSpec:
    """A tenant's adapter: its name (the PEFT adapter name) and LoRA hyper-parameters."""

    name: str
    rank: int
    alpha: float = 32.0
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    seed: int = 0


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's settings (the Tinker SDK's `AdamParams` and defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # clip this tenant's gradient norm to this first; 0 = no clipping


@dataclass(frozen=True)
class Datum:
    """One sequence of one tenant: position i scores `tokens[i + 1]`; `inputs` holds the loss's
    per-position values (graft.tenants.losses), one per scored position (len(tokens) - 1)."""

    tenant: str
    tokens: Sequence[int]
    inputs: dict[str, Sequence[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class DatumResult:
    """A datum's loss and its log-probs at the scored positions (before any step)."""

    loss: float
    logprobs: list[float]


@dataclass(frozen=True)
class TenantState:
    """A tenant's whole LoRA factors, their gradients (None: none since its last step) and its AdamW
    state, by PEFT name: what a checkpoint saves, and what a sharded policy's rebuild carries over."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    moments: dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class OptimStepResult:
    """What `optim_step` did: applied, the gradient norm it saw, and why not when refused."""

    applied: bool
    grad_norm: float
    refused: str = ""


class TenantPolicy:
    """Tenants' adapters on `base` (module docstring). `base` is wrapped in place by PEFT at the first
    `add`; `pad_id` fills the padded positions (never scored); `pass_tokens` bounds one forward pass;
    `batch_invariant`: each tenant's results bit-equal to its own alone (module docstring)."""

    def __init__(self, base: nn.Module, pad_id: int = 0, pass_tokens: int = PASS_TOKENS, *,
                 batch_invariant: bool = False) -> None:
        self._base = base
        self.batch_invariant = batch_invariant
        self.pass_tokens = pass_tokens
        self.model: peft.PeftModel | None = None
        self.pad_id = pad_id
        self.tenants: dict[str, TenantSpec] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._removed: str | None = None  # the last tenant removed, kept in PEFT until another exists

    def add(self, spec: TenantSpec) -> None:
        """A new tenant: its adapter initialised from `spec.seed` as `attach_lora(seed=...)` would
        (lora_B zero, so it starts as the base), and its optimizer.

        Raises:
            TenantError: the name is taken or cannot name a PEFT adapter.
        """
        if spec.name in self.tenants or spec.name == self._removed:
            raise TenantError(f"tenant {spec.name!r} exists already")
        if not spec.name or "." in spec.name:
            raise TenantError(f"a tenant name must be non-empty and without '.', got {spec.name!r}")
        config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=list(spec.target_modules) if isinstance(spec.target_modules, tuple)
                                 else spec.target_modules)
        torch.manual_seed(spec.seed)
        if self.model is None:
            self.model = peft.get_peft_model(self._base, config, adapter_name=spec.name)
        else:
            self.model.add_adapter(spec.name, config)
        self.tenants[spec.name] = spec
        self._optimizers[spec.name] = torch.optim.AdamW(self.parameters(spec.name).values())
        if self._removed is not None:
            self._delete(self._removed)
            self._removed = None
        self._train_every_adapter()

    def remove(self, tenant: str) -> None:
        """Forget `tenant`: its adapter and optimizer state go (its name may be used again). PEFT cannot
        hold a model without adapters, so the last one goes only when the next tenant is added."""
        self._require(tenant)
        del self.tenants[tenant], self._optimizers[tenant]
        if self.tenants:
            self._delete(tenant)
        else:
            self._removed = tenant

    def _delete(self, adapter: str) -> None:
        """Delete a PEFT adapter; PEFT's model-level active adapter must then name one that exists."""
        self.model.delete_adapter(adapter)
        self.model.set_adapter(next(iter(self.tenants)))
        self._train_every_adapter()

    def _train_every_adapter(self) -> None:
        """Every tenant's LoRA weights trainable (PEFT makes only its active adapter trainable)."""
        for name, param in self.model.named_parameters():
            param.requires_grad_(".lora_" in name)

    def parameters(self, tenant: str) -> dict[str, nn.Parameter]:
        """`tenant`'s LoRA parameters by PEFT name (`...q_proj.lora_A.<tenant>.weight`)."""
        self._require(tenant)
        return {name: param for name, param in self.model.named_parameters()
                if any(f".{kind}.{tenant}." in name for kind in ("lora_A", "lora_B"))}

    def optimizer(self, tenant: str) -> torch.optim.Optimizer:
        """`tenant`'s AdamW (its state is what a checkpoint saves, graft.tenants.checkpoint)."""
        self._require(tenant)
        return self._optimizers[tenant]

    def tenant_state(self, tenant: str) -> TenantState:
        """`tenant`'s adapter, gradients and optimizer state as they are (detached, not copied)."""
        state = self.optimizer(tenant).state
        params = self.parameters(tenant)
        return TenantState({name: p.detach() for name, p in params.items()},
                           {name: p.grad for name, p in params.items()},
                           {name: dict(state.get(p, {})) for name, p in params.items()})

    def set_tenant_state(self, tenant: str, state: TenantState) -> None:
        """Put `state` (whole tensors) into `tenant`: its adapter, gradients, and AdamW state (a
        parameter without moments starts its AdamW afresh)."""
        optimizer = self.optimizer(tenant)
        with torch.no_grad():
            for name, param in self.parameters(tenant).items():
                param.copy_(state.params[name])
                param.grad = state.grads[name]
                if state.moments[name]:
                    optimizer.state[param] = {key: v.to(param.device) for key, v in state.moments[name].items()}
                else:
                    optimizer.state.pop(param, None)

    def forward_backward(self, datums: Sequence[Datum], loss: str, *, backward: bool = True,
                         config: Mapping[str, float] | None = None) -> list[DatumResult]:
        """One forward and backward over `datums` of any tenants together; each tenant's gradients
        accumulate (until its `optim_step`) from its own datums' `loss` only. `backward=False`: the
        losses and log-probs alone, no gradients. `config`: the loss's `loss_fn_config` (its keys'
        defaults for the rest, graft.tenants.losses.loss_config).

        Datums past `pass_tokens` padded tokens go in further passes, each with its own backward:
        losses are sums, so the gradients are the same (up to float summation order), and memory
        stays bounded (one pass over 128 SmolLM2-135M rows of 46 tokens held ~10 GB of activations).

        Raises:
            TenantError: an unknown tenant or loss, a config the loss does not take, or a datum without
                the loss's inputs.
        """
        losses_fn, needs, filled = self._check(datums, loss, config)
        losses_fn = functools.partial(losses_fn, config=filled)  # `_pass` calls it as (logprobs_C, inputs)
        results = []
        device = next(self.model.parameters()).device
        with update_memory_cached(host_memory_mode("auto", device)):  # as the trainer's update
            for indices in self._passes(datums):
                results += zip(indices, self._pass([datums[i] for i in indices], losses_fn, needs, backward))
        return [result for _, result in sorted(results, key=lambda pair: pair[0])]

    def _passes(self, datums: Sequence[Datum]) -> list[list[int]]:
        """Indices into `datums`, one list per forward pass."""
        if self.batch_invariant:
            return invariant_passes(datums, self.pass_tokens)
        starts = [0]
        for chunk in passes_of(datums, self.pass_tokens):
            starts.append(starts[-1] + len(chunk))
        return [list(range(start, end)) for start, end in zip(starts, starts[1:])]

    def _pass(self, datums: Sequence[Datum], losses_fn, needs, backward: bool) -> list[DatumResult]:
        names = list(dict.fromkeys(datum.tenant for datum in datums))
        ids_BT, mask_BT, score_BT, adapter_BT = self._layout(datums, names)
        self.model.train()
        lengths_B = [len(datum.tokens) for datum in datums]
        invariant = batch_invariant(self.model, lengths_B) if self.batch_invariant else contextlib.nullcontext()
        with routed(self.model, adapter_BT, names), invariant, torch.set_grad_enabled(backward):
            logprobs_BT = teacher_forced_logprobs(self.model, ids_BT, mask_BT, score_mask_BT=score_BT).logprobs_BT
        total, results = logprobs_BT.new_zeros(()), []
        for row, datum in enumerate(datums):
            logprobs_C = logprobs_BT[row, :len(datum.tokens) - 1]
            inputs = {key: torch.tensor(datum.inputs[key], dtype=torch.float32, device=logprobs_C.device)
                      for key in needs}
            datum_loss = losses_fn(logprobs_C, inputs)
            total = total + datum_loss
            results.append(DatumResult(datum_loss.item(), logprobs_C.detach().tolist()))
        if backward:
            total.backward()
        return results

    def optim_step(self, tenant: str, adam: AdamParams = AdamParams()) -> OptimStepResult:
        """Step `tenant`'s adapter with its accumulated gradients, then clear them. Non-finite
        gradients (a NaN loss) are cleared and the step refused: this tenant's adapter stays as it
        was, and no other tenant is touched."""
        params = list(self.parameters(tenant).values())
        seen, grad_norm = self._grad_norm(tenant, params)
        optimizer = self._optimizers[tenant]
        if not seen:
            optimizer.zero_grad(set_to_none=True)
            return OptimStepResult(False, 0.0, "no gradients: no forward_backward since its last step")
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            return OptimStepResult(False, grad_norm, "non-finite gradients: the step is refused, the adapter kept")
        if adam.grad_clip_norm > 0 and (coef := adam.grad_clip_norm / (grad_norm + 1e-6)) < 1.0:  # torch's
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(coef)
        for group in optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return OptimStepResult(True, grad_norm)

    def _grad_norm(self, tenant: str, params: list[nn.Parameter]) -> tuple[bool, float]:
        """(whether `tenant` has gradients to step with, their whole norm)."""
        grads = [param.grad for param in params if param.grad is not None]
        if not grads:
            return False, 0.0
        return True, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    @torch.no_grad()
    def logprobs(self, tenant: str, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """`tenant`'s teacher-forced log-probs of `completion` after `prompt`, in eval mode: the
        trainer's side of a comparison with what a server serves as this tenant's adapter (the
        forward routes every token to `tenant`, as a batch of that adapter alone computes it)."""
        self._require(tenant)
        adapter_BT = torch.zeros((1, len(prompt) + len(completion)), dtype=torch.long)
        with eval_mode(self.model), routed(self.model, adapter_BT, [tenant]):
            return sequence_logprobs(self.model, prompt, completion)

    def _require(self, tenant: str) -> None:
        if tenant not in self.tenants:
            raise TenantError(f"unknown tenant {tenant!r} (tenants: {', '.join(self.tenants) or 'none'})")

    def _check(self, datums: Sequence[Datum], loss: str, config: Mapping[str, float] | None = None):
        if loss not in LOSSES:
            raise TenantError(f"unknown loss {loss!r} (losses: {', '.join(LOSSES)})")
        try:
            filled = loss_config(loss, config)
        except LossConfigError as error:
            raise TenantError(str(error)) from None
        if not datums:
            raise TenantError("forward_backward needs at least one datum")
        losses_fn, needs, _ = LOSSES[loss]
        for index, datum in enumerate(datums):
            self._require(datum.tenant)
            if len(datum.tokens) < 2:
                raise TenantError(f"datum {index}: needs at least 2 tokens (position i scores token i + 1)")
            for key in needs:
                if len(datum.inputs.get(key, ())) != len(datum.tokens) - 1:
                    raise TenantError(f"datum {index}: loss {loss!r} needs {key!r} with one value per scored "
                                      f"position ({len(datum.tokens) - 1}), got {len(datum.inputs.get(key, ()))}")
        return losses_fn, needs, filled

    def _layout(self, datums: Sequence[Datum], names: list[str]):
        """The right-padded batch: ids, attention mask, the positions scored, each token's adapter."""
        device = next(self.model.parameters()).device
        rows, width = len(datums), max(len(datum.tokens) for datum in datums)
        ids_BT = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros((rows, width), dtype=torch.long)
        score_BT = torch.zeros((rows, width), dtype=torch.bool)
        adapter_BT = torch.full((rows, width), BASE_ONLY, dtype=torch.long)
        for row, datum in enumerate(datums):
            n = len(datum.tokens)
            ids_BT[row, :n] = torch.tensor(list(datum.tokens))
            mask_BT[row, :n], score_BT[row, :n - 1], adapter_BT[row, :n] = 1, True, names.index(datum.tenant)
        return ids_BT.to(device), mask_BT.to(device), score_BT.to(device), adapter_BT.to(device)
