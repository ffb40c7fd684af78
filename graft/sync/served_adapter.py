"""`graft verify`: does a running server serve exactly this PEFT adapter? For any LoRA trainer's adapters.

The same proof graft's runs make after every sync (graft.sync.verify): the server answers a fixed
probe prompt greedily under the adapter's name, the adapter is applied to the base here and
teacher-forces the server's tokens, and the largest per-token log-prob gap decides. When the gap is
too large, the server's log-probs are compared with what the usual ways of failing to deliver an
adapter would serve, each a variant of the local model computed the same way (`SUSPECTS`): the
base model alone (the adapter loaded but never applied, or never requested), the adapter with its
scaling applied twice (an engine that scales lora_B in place and again after a reload), and the
adapter without one target module (a module that never reached the engine). The first variant the
server matches within the tolerance is named as the likely cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import peft
from peft.tuners.lora import LoraLayer

from graft.lora.attach import ADAPTER_NAME, adapter_disabled
from graft.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams
from graft.rollout.pool import engine_address
from graft.sync.source import ModelSource
from graft.sync.verify import PROBE_NEW_TOKENS, PROBE_PROMPT, dtype_hint


@dataclass(frozen=True)
class Verdict:
    """What `verify_served_adapter` found: the gap, whether it is within the tolerance, and the likely
    cause when it is not ("" when no suspect matched either)."""

    address: str
    name: str
    gap: float
    tolerance: float
    cause: str = ""

    @property
    def passed(self) -> bool:
        return self.gap <= self.tolerance

    def line(self) -> str:
        if self.passed:
            return (f"{self.address} serves adapter {self.name!r} exactly: largest log-prob gap {self.gap:.3g} "
                    f"on the probe (tolerance {self.tolerance:g})")
        cause = f"; {self.cause}" if self.cause else ""
        return (f"{self.address} does not serve this adapter as {self.name!r}: largest log-prob gap {self.gap:.3g} "
                f"on the probe (tolerance {self.tolerance:g}){cause}")


@contextlib.contextmanager
def _scaled(model: peft.PeftModel, factor: float, where: Callable[[str], bool] = lambda name: True) -> Iterator[None]:
    """The adapter's LoRA scaling times `factor` in the modules `where(name)` selects, for the body."""
    layers = [module for name, module in model.named_modules() if isinstance(module, LoraLayer) and where(name)]
    saved = [module.scaling[ADAPTER_NAME] for module in layers]
    try:
        for module in layers:
            module.scaling[ADAPTER_NAME] *= factor
        yield
    finally:
        for module, scaling in zip(layers, saved):
            module.scaling[ADAPTER_NAME] = scaling


def _target_kinds(model: peft.PeftModel) -> list[str]:
    """The adapter's target module kinds (q_proj, up_proj, ...), in model order."""
    kinds = [name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    return list(dict.fromkeys(kinds))


def suspects(model: peft.PeftModel) -> list[tuple[str, Callable[[], contextlib.AbstractContextManager]]]:
    """(likely cause, the local model's state that would serve it) for each way of failing to deliver."""
    found = [("the server answers with the base model: the adapter is not applied (loaded but never requested, "
              "or its modules matched nothing)", lambda: adapter_disabled(model)),
             ("the server applies the adapter's scaling twice (lora_B scaled in place, then again)",
              lambda: _scaled(model, 2.0))]
    for kind in _target_kinds(model):
        found.append((f"the server applies the adapter without its {kind} LoRA (that module never reached it)",
                      lambda kind=kind: _scaled(model, 0.0, lambda name: name.rsplit(".", 1)[-1] == kind)))
    return found


def _gap(served: Sequence[float], local: Sequence[float]) -> float:
    return max(abs(a - b) for a, b in zip(served, local))


async def verify_served_adapter(engine: RolloutEngine, model: peft.PeftModel, name: str, tolerance: float,
                                probe: Sequence[int] = PROBE_PROMPT) -> Verdict:
    """Whether `engine` serves `model`'s adapter (base + adapter, held here) under `name`.

    Raises:
        UnknownAdapterError: no adapter `name` is loaded on the server.
        EngineError: the server could not be asked.
    """
    params = SamplingParams(temperature=0, max_new_tokens=PROBE_NEW_TOKENS, ignore_eos=True)
    completion = (await engine.generate([GenerateRequest(tuple(probe), params)], adapter=name))[0][0]
    source = ModelSource(model)
    gap = _gap(completion.logprobs, source.logprobs(probe, completion.token_ids))
    address = engine_address(engine)
    if gap <= tolerance:
        return Verdict(address, name, gap, tolerance)
    for cause, state in suspects(model):
        with state():
            if _gap(completion.logprobs, source.logprobs(probe, completion.token_ids)) <= tolerance:
                return Verdict(address, name, gap, tolerance, cause)
    return Verdict(address, name, gap, tolerance, dtype_hint(gap, tolerance).removeprefix("; "))
