"""Delivery verification: after a sync, the engine serves exactly the trainer's policy.

The failures other systems suffer silently — an adapter never delivered, merged weights read after
an unmerge, a name mismatch between the load side and the request side — all show up as a gap
between the engine's log-probs and the trainer's on the same tokens. So after each sync: the
expected adapter must be listed (adapter mode), then the engine answers a fixed probe prompt
greedily and the trainer teacher-forces the engine's tokens; the largest per-token log-prob gap is
the step's `sync_logprob_abs_diff_max`. Above the tolerance the sync fails (or warns, if so configured).
The tolerance is fixed for float32; for a half-precision model it is measured at the run's version
0 (`noise_floor`, `calibrated_tolerance`): the engines' rounding grows with the model.

The probe names what rollouts name (`requested`: the sync's `request_adapter`, through the same
engine call), not what the sync loaded: a load-side name the requests never use, or requests that
reach the base model, fail the check rather than pass it.

A failure names its likely cause where the engine's answer shows one: the engine's log-probs are
compared with what the usual ways of failing to deliver an adapter would serve, each a variant of
the trainer's model teacher-forced the same way (`suspects`): the base model alone (the adapter
loaded but never applied, or never requested), the adapter with its scaling applied twice (an engine
that scales lora_B in place and again after a reload: the scaling squared), and the adapter without
one target module (a module that never reached the engine). If none matches, the engine answers the probe reversed,
which shares no prefix with it: if that one agrees, the probe was served from stale prefix-cache
blocks (a version reloaded under the same name and path keeps its predecessor's KV, vLLM #42125).
Else a gap of bf16 rounding names the dtype.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from types import EllipsisType

import peft
from peft.tuners.lora import LoraLayer

from graft.lora.attach import ADAPTER_NAME, adapter_disabled
from graft.rollout.engine import (
    Completion,
    EngineError,
    EngineUnavailableError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
)
from graft.rollout.pool import EnginePool, engine_address, pool_members
from graft.sync.source import ModelSource, Policy, PolicySource, policy_source

# A fixed probe: token ids every tokenizer of a real model has; long enough to cross a 16-token KV
# block (vLLM's default on CUDA), so a stale prefix cache can serve part of it there.
PROBE_PROMPT = tuple(range(3, 3 + 24))
# `graft verify`'s probe, for servers graft does not drive: it also fills one 128-token block (vLLM-CPU's),
# whose KV a same-name, same-path reload leaves stale (measured: the 24-token probe passed at 4.8e-7
# beside a 136-token prompt served off by 0.167 after such a reload on vLLM-CPU).
BLOCK_FILLING_PROBE = tuple(range(3, 3 + 136))
STALE_CACHE = ("a prompt with no cached prefix agrees: the probe was served from stale prefix-cache blocks "
               "(a version reloaded under the same name and path keeps its predecessor's KV cache)")
# 8 decode steps: with 4 the check cost a quickstart step +3.0% instead of 5-12%, but missed a base-model
# request served another slot's adapter (tests/sync/faults), whose gap shows only on later tokens.
PROBE_NEW_TOKENS = 8
# fp32 engines match the trainer to ~1e-6 (measured 5e-7 on vLLM-CPU); bf16 engines round weights
# and activations, which moves log-probs by up to a few 1e-2 on the tiny models.
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
# A half-precision model's rounding gap grows with the model: SmolLM2-135M in bf16 on vLLM-CPU, every
# version correctly delivered, gave 0.13, 0.06, 0.15, 0.14, 0.06, 0.09 at versions 1-6 (a fixed 0.1
# failed the run). So with `sync.verify_tolerance: null` a half-precision run measures its engines'
# gap on the version it starts from, `noise_floor`, and allows this many times it (never less than
# DEFAULT_TOLERANCE): 3x the largest of the two probes, whose own spread above was 2.5x. At most
# MAX_CALIBRATED, so that engines that are off from the start (another model, broken weights: gaps of
# whole nats) still fail version 0's check instead of widening it.
NOISE_MARGIN = 3.0
MAX_CALIBRATED = 0.5

log = logging.getLogger(__name__)


class DeliveryError(EngineError):
    """The engine does not serve the policy the trainer just published. `gap`: the log-prob gap
    measured (inf when the adapter was not even loaded)."""

    def __init__(self, message: str, *, address: str, gap: float = float("inf")) -> None:
        super().__init__(message, address=address)
        self.gap = gap


async def verify_delivery(engine: RolloutEngine, policy: Policy, *, adapter: str | None, tolerance: float,
                          warn_only: bool = False, probe: Sequence[int] = PROBE_PROMPT,
                          requested: str | None | EllipsisType = ...) -> float:
    """Check every engine (each member of a pool) against `policy`; the largest log-prob gap seen.

    Args:
        engine: the engine or pool the sync just updated.
        policy: the trainer's policy in the state that was published (adapter enabled, if any): a
            model, or a source (an FSDP2 run's rank 0: each probe forward is a collective).
        adapter: the name the sync loaded (adapter mode), or None (merged/full: the base name).
        requested: the name rollouts request (the sync's `request_adapter`; None: the base model's
            name), which the probe requests too; default `adapter`.
        tolerance: largest allowed |engine log-prob − trainer log-prob| on any probe token.
        warn_only: log a warning instead of raising.

    Raises:
        DeliveryError: the adapter is not listed, or a gap exceeds `tolerance` (unless warn_only).
    """
    members = pool_members(engine)
    source = policy_source(policy)
    worst = 0.0
    for member in members:
        try:
            worst = max(worst, await _verify_one(member, source, adapter, adapter if requested is ... else requested,
                                                 tolerance, probe))
        except DeliveryError as error:
            if not warn_only:
                raise
            log.warning("%s", error)
            worst = max(worst, error.gap)
        except EngineUnavailableError as error:
            # A pool member that stopped serving while it was checked (the check runs beside the
            # next rollout) is dropped like one that fails a request; the rest are still checked.
            if not (isinstance(engine, EnginePool) and await engine.drop_if_down(member, error)):
                raise
    return worst


async def _verify_one(engine: RolloutEngine, source: PolicySource, adapter: str | None, requested: str | None,
                      tolerance: float, probe: Sequence[int]) -> float:
    address = engine_address(engine)
    if adapter is not None and adapter not in (listed := await engine.list_adapters()):
        raise DeliveryError(f"adapter {adapter!r} is not loaded (the sync did not deliver it)", address=address)
    if requested is not None and requested != adapter and requested not in listed:
        raise DeliveryError(f"rollouts request adapter {requested!r}, which the engine does not serve (the sync "
                            f"loaded {adapter!r}): requests never reach the new version", address=address)
    completion, gap = await probe_gap(engine, source, requested, probe)
    if gap > tolerance:
        cause = await diagnosis(engine, source, requested, probe, completion, gap, tolerance)
        served = f"adapter {requested!r}" if requested else "the base model name"
        aside = f" (the sync loaded {adapter!r})" if requested != adapter else ""
        raise DeliveryError(f"engine log-probs differ from the trainer's by {gap:.3g} (tolerance {tolerance:g}) "
                            f"on the probe prompt, serving {served}{aside}: the engine is not serving the "
                            f"published policy; {cause or 'no known cause matches'}",
                            address=address, gap=gap)
    return gap


async def probe_gap(engine: RolloutEngine, source: PolicySource, adapter: str | None, probe: Sequence[int]
                    ) -> tuple[Completion, float]:
    """The engine's greedy completion of `probe` under `adapter` (None: the base model's name), and its
    gap to `source`'s log-probs of the same tokens."""
    params = SamplingParams(temperature=0, max_new_tokens=PROBE_NEW_TOKENS, ignore_eos=True)
    completion = (await engine.generate([GenerateRequest(tuple(probe), params)], adapter=adapter))[0][0]
    local = await source.read(lambda: source.logprobs(probe, completion.token_ids))
    return completion, logprob_gap(completion.logprobs, local)


async def diagnosis(engine: RolloutEngine, source: PolicySource, adapter: str | None, probe: Sequence[int],
                    completion: Completion, gap: float, tolerance: float) -> str:
    """The likely cause of a failed probe (module docstring): a suspect that matches; else stale
    prefix-cache blocks, when the same probe reversed (no prefix in common, so nothing cached) agrees;
    else the dtype hint; "" when none applies."""
    cause = await source.read(lambda: likely_cause(source, probe, completion, gap, tolerance))
    if not cause and (await probe_gap(engine, source, adapter, tuple(reversed(probe))))[1] <= tolerance:
        cause = STALE_CACHE
    return cause or dtype_hint(gap, tolerance)


def logprob_gap(served: Sequence[float], local: Sequence[float]) -> float:
    """The largest per-token |served - local| log-prob difference."""
    return max(abs(a - b) for a, b in zip(served, local))


def likely_cause(source: PolicySource, probe: Sequence[int], completion: Completion, gap: float,
                 tolerance: float) -> str:
    """Why the engine's `completion` of `probe` is off by `gap`, where a suspect matches it within
    `tolerance` and the probe tells that suspect from the published policy (their own gap is over
    `tolerance`: a version barely different from the base must not be reported as the base served
    when the engine's rounding put it a little past the tolerance); "" when none does. Only a model
    held whole in this process is varied: an FSDP2 run's forwards are collectives the other ranks
    would not join."""
    if isinstance(source, ModelSource) and isinstance(source.model, peft.PeftModel):
        policy = source.logprobs(probe, completion.token_ids)
        for cause, state in suspects(source.model):
            with state():
                suspect = source.logprobs(probe, completion.token_ids)
            if logprob_gap(completion.logprobs, suspect) <= tolerance < logprob_gap(policy, suspect):
                return cause
    return ""


async def noise_floor(engine: RolloutEngine, source: PolicySource, requested: str | None) -> float:
    """The largest gap between every engine serving `requested` and the trainer's policy `source` over
    the probe and the probe reversed: the engines' rounding where the policy is what they serve (a
    fresh run's version 0, whose LoRA adds nothing, whatever an engine made of it)."""
    members = pool_members(engine)
    return max([(await probe_gap(member, source, requested, probe))[1]
                for member in members for probe in (PROBE_PROMPT, tuple(reversed(PROBE_PROMPT)))])


async def base_calibrated_tolerance(engine: RolloutEngine, model: peft.PeftModel, dtype: str) -> float:
    """A `dtype` server's tolerance from its base model against `model`'s base, whatever the adapter
    under test did (`graft verify`: no version 0 of its own); fp32: the fixed one."""
    if dtype == "float32":
        return DEFAULT_TOLERANCE[dtype]
    with adapter_disabled(model):
        return calibrated_tolerance(await noise_floor(engine, ModelSource(model), None), dtype)


def calibrated_tolerance(floor: float, dtype: str) -> float:
    """The delivery check's tolerance for a `dtype` model whose engines showed `floor` (NOISE_MARGIN)."""
    return max(DEFAULT_TOLERANCE[dtype], min(NOISE_MARGIN * floor, MAX_CALIBRATED))



def dtype_hint(gap: float, tolerance: float) -> str:
    """A float32 tolerance failed by a gap a bfloat16 engine would give (measured: 0.002 on the tiny
    model served by `graft serve`'s default dtype): name the likely cause."""
    bf16 = DEFAULT_TOLERANCE["bfloat16"]
    if tolerance >= bf16 or gap > bf16:
        return ""
    return (f"a gap this small (under the bfloat16 tolerance {bf16:g}) is what an engine serving bfloat16 weights "
            "gives under model.dtype float32: start the server with `graft serve --dtype float32` (vLLM --dtype "
            "float32) or set model.dtype to the engine's dtype")


@contextlib.contextmanager
def _scaled(model: peft.PeftModel, factor: float | None, where: Callable[[str], bool] = lambda name: True
            ) -> Iterator[None]:
    """The adapter's LoRA scaling times `factor` (None: times itself, squared) in the modules `where(name)`
    selects, for the body."""
    layers = [module for name, module in model.named_modules() if isinstance(module, LoraLayer) and where(name)]
    saved = [module.scaling[ADAPTER_NAME] for module in layers]
    try:
        for module in layers:
            module.scaling[ADAPTER_NAME] *= module.scaling[ADAPTER_NAME] if factor is None else factor
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
              lambda: _scaled(model, None))]
    for kind in _target_kinds(model):
        found.append((f"the server applies the adapter without its {kind} LoRA (that module never reached it)",
                      lambda kind=kind: _scaled(model, 0.0, lambda name: name.rsplit(".", 1)[-1] == kind)))
    return found
