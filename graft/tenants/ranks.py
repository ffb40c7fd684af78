"""The Tinker service on FSDP2 / TP ranks: rank 0 answers HTTP, every rank trains (`RankedTenantPolicy`).

`torchrun --nproc-per-node N --no-python graft tenants serve ... [--tp T]` starts N ranks on a
(N / T, T) mesh. Rank 0 runs the service as one process does (HTTP, scheduling, engines); its
policy is a `RankedTenantPolicy`, which turns each policy call the service makes into a command for
every rank. The service makes them all on its one model thread, so every rank sees them in one
order. A command is a JSON header (a uint8 tensor) and the call's token ids and per-position values
as tensors, broadcast from rank 0; nothing is pickled. Ranks > 0 wait in `follow`, run each command
on their shard of the model (graft.tenants.sharded), until rank 0 sends `stop`.

forward_backward: the datums are cut into one contiguous share per data-parallel rank (the ranks of
a TP group run the same share); the sharded policy sums each tenant's gradient over the ranks, and
each datum's loss and log-probs reach rank 0 in one sum over the data-parallel ranks (each fills its
own datums' places, zeros elsewhere). A refused call (unknown tenant, malformed datum) is refused on
every rank alike; rank 0 tells the client, the others go on.

Tenants come and go, but a sharded policy's tenants are fixed when it is built (FSDP2 and TP shard
each adapter once). So a create or a remove REBUILDS it: every rank gathers the kept tenants' whole
factors, gradients and AdamW moments (megabytes), drops the old model, loads the base again, shards
it with the new set of tenants (a new tenant initialised from its seed, as on one process), and puts
each kept tenant's state back into its shards, bit for bit, so a rebuild changes no tenant's
training. Chosen over a fixed number of tenant slots made at start: clients choose each model's rank
and target modules, which a slot fixes, and a slot reset to a tenant's own initialisation would have
to replay PEFT's random draws outside PEFT. The cost is one load of the base and one sharding per
create or remove (the tiny test model on 2 gloo ranks: 0.8-1.2 s on 2 loaded cores; it grows with
the base).

Publishing (`RankedSource`): the tenant's factors gathered whole on rank 0 (a command), its non-finite
probe and delivery check forwards run as commands on the sharded model. No snapshot swap: a tenant's
publish is one of its own operations, so its next step waits for the publish and its delivery check.

Saved states: `save_state` gathers the tenant's state whole on rank 0 (a command), which writes it;
`load_state` reads it on rank 0 and sends it to every rank (float64 on the wire: exact for fp32).

A rank that fails outside a refusal (out of memory) leaves the others in a collective; torchrun then
ends the run. SIGTERM: torchrun hands it to every rank; rank 0's service stops (its vLLM servers
with it) and tries to send `stop`, the others end at once.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from graft.lora.routing import routed
from graft.models.loading import load_model
from graft.parallel.dist import Dist, broadcast_ints, broadcast_tensor
from graft.parallel.parallelize import check_tensor_parallel, reshard
from graft.sync.source import probe_logits_finite
from graft.tenants.policy import (
    AdamParams,
    Datum,
    DatumResult,
    OptimStepResult,
    TenantError,
    TenantSpec,
    TenantState,
)
from graft.tenants.sharded import ShardedTenantPolicy
from graft.tenants.source import TenantSource
from graft.tenants.users import PASS_TOKENS

log = logging.getLogger(__name__)

STOP = "stop"
_DTYPES = {"long": torch.long, "double": torch.float64}


def _send(op: str, header: dict, tensors: Sequence[torch.Tensor] = ()) -> None:
    """Rank 0: command `op` with its JSON `header` and 1-D `tensors` (long or float64) to every rank."""
    kinds = [[next(k for k, d in _DTYPES.items() if d == t.dtype), t.numel()] for t in tensors]
    data = json.dumps({"op": op, "tensors": kinds, **header}).encode()
    broadcast_ints([len(data)], 1)
    broadcast_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for tensor in tensors:
        if tensor.numel():
            broadcast_tensor(tensor)


def _receive() -> tuple[str, dict, list[torch.Tensor]]:
    """Ranks > 0: rank 0's next command (its op, header and tensors)."""
    size = broadcast_ints(None, 1)[0]
    header = json.loads(bytes(broadcast_tensor(torch.zeros(size, dtype=torch.uint8)).tolist()))
    tensors = [broadcast_tensor(torch.zeros(n, dtype=_DTYPES[kind])) if n else torch.zeros(0, dtype=_DTYPES[kind])
               for kind, n in header.pop("tensors")]
    return header.pop("op"), header, tensors


class RankedTenantPolicy:
    """A `TenantPolicy` whose every call runs on all ranks (module docstring): rank 0's service calls
    it; ranks > 0 call `follow`. Every rank builds it alike, with the base at `model_dir` in `dtype`.

    Raises:
        ValueError: `batch_invariant` with tensor parallelism (as `ShardedTenantPolicy`).
    """

    def __init__(self, model_dir: Path, ctx: Dist, *, dtype: str = "float32", pad_id: int = 0,
                 pass_tokens: int = PASS_TOKENS, batch_invariant: bool = False) -> None:
        if batch_invariant and ctx.tp > 1:
            raise ValueError(f"batch_invariant runs with data parallelism only, not tp={ctx.tp}")
        self.ctx, self.model_dir, self.dtype = ctx, model_dir, dtype
        self.pad_id, self.pass_tokens, self.batch_invariant = pad_id, pass_tokens, batch_invariant
        self.base = load_model(model_dir, dtype)  # the next build's; its config gives the service's bounds
        self.config = self.base.config
        self.specs: list[TenantSpec] = []
        self.sharded: ShardedTenantPolicy | None = None
        self.rebuild_seconds: list[float] = []  # each rebuild's time on this rank

    @property
    def tenants(self) -> dict[str, TenantSpec]:
        return {spec.name: spec for spec in self.specs}

    @property
    def model(self):
        return self.sharded.model if self.sharded is not None else None

    # What the service calls (rank 0): each a command, then rank 0's own part of it.

    def add(self, spec: TenantSpec) -> None:
        """A new tenant (a rebuild on every rank).

        Raises:
            TenantError: the name is taken or cannot name an adapter (before any command).
            ValueError: `tp` cannot split the tenant's target modules (before any command).
        """
        if spec.name in self.tenants or not spec.name or "." in spec.name:
            raise TenantError(f"tenant {spec.name!r} exists already or cannot name an adapter")
        check_tensor_parallel(self.config, self.ctx.tp, spec.target_modules)
        _send("add", {"spec": dataclasses.asdict(spec)})
        self._rebuild([*self.specs, spec])

    def remove(self, tenant: str) -> None:
        """Forget `tenant` (a rebuild on every rank).

        Raises:
            TenantError: an unknown tenant (before any command).
        """
        if tenant not in self.tenants:
            raise TenantError(f"unknown tenant {tenant!r}")
        _send("remove", {"tenant": tenant})
        self._rebuild([spec for spec in self.specs if spec.name != tenant])

    def forward_backward(self, datums: Sequence[Datum], loss: str, *, backward: bool = True,
                         config: Mapping[str, float] | None = None) -> list[DatumResult]:
        """`TenantPolicy.forward_backward` over every rank's share (module docstring).

        Raises:
            TenantError: refused, with the reason, before any command (an empty share on some rank
                would only learn that another's was refused).
        """
        self._sharded()._check(datums, loss, config)
        keys = [sorted(datum.inputs) for datum in datums]
        lengths = torch.tensor([len(datum.tokens) for datum in datums], dtype=torch.long)
        tokens = torch.tensor([t for datum in datums for t in datum.tokens], dtype=torch.long)
        values = torch.tensor([v for datum, names in zip(datums, keys) for key in names for v in datum.inputs[key]],
                              dtype=torch.float64)
        header = {"loss": loss, "backward": backward, "config": dict(config) if config is not None else None,
                  "tenants": [datum.tenant for datum in datums], "keys": keys}
        _send("forward_backward", header, [lengths, tokens, values])
        return self._forward_backward(header, datums)

    def optim_step(self, tenant: str, adam: AdamParams = AdamParams()) -> OptimStepResult:
        _send("optim_step", {"tenant": tenant, "adam": dataclasses.asdict(adam)})
        return self._sharded().optim_step(tenant, adam)

    def tenant_state(self, tenant: str) -> TenantState:
        _send("tenant_state", {"tenant": tenant})
        return self._sharded().tenant_state(tenant)

    def full_parameters(self, tenant: str) -> dict[str, torch.Tensor]:
        _send("full_parameters", {"tenant": tenant})
        return self._sharded().full_parameters(tenant)

    def logprobs(self, tenant: str, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        ids = torch.tensor([*prompt, *completion], dtype=torch.long)
        _send("logprobs", {"tenant": tenant, "prompt": len(prompt)}, [ids])
        return self._sharded().logprobs(tenant, prompt, completion)

    def probe_logits_finite(self, tenant: str, probe: Sequence[int]) -> bool:
        _send("probe", {"tenant": tenant}, [torch.tensor(list(probe), dtype=torch.long)])
        return self._probe(tenant, list(probe))

    def parameters(self, tenant: str) -> dict[str, torch.nn.Parameter]:
        """This rank's shards of `tenant`'s factors (no command: the scheduler's gradient copies)."""
        return self._sharded().parameters(tenant)

    def set_tenant_state(self, tenant: str, state: TenantState) -> None:
        """`state` (rank 0's, read from a saved state) into `tenant`'s shards on every rank."""
        names = list(state.params)
        moments = [[name, key] for name in names for key in state.moments[name]]
        whole = [state.params[name] for name in names] + [state.moments[name][key] for name, key in moments]
        layout = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in whole]
        header = {"tenant": tenant, "names": names, "moments": moments, "layout": layout}
        tensors = [t.detach().double().flatten() for t in whole]
        _send("set_tenant_state", header, tensors)
        self._set_state(header, tensors)

    def release_followers(self) -> None:
        """Rank 0, once the service is closed: the other ranks leave `follow`."""
        _send(STOP, {})

    # Ranks > 0.

    def follow(self) -> None:
        """Run rank 0's commands on this rank's shard, in its order, until `stop`."""
        while True:
            op, header, tensors = _receive()
            if op == STOP:
                return
            try:
                _FOLLOW[op](self, header, tensors)
            except TenantError as error:  # refused on every rank alike: rank 0 answers the client
                log.debug("rank %d: %s refused: %s", self.ctx.rank, op, error)

    # What every rank runs.

    def _sharded(self) -> ShardedTenantPolicy:
        if self.sharded is None:
            raise TenantError("unknown tenant: the service holds no tenants")
        return self.sharded

    def _rebuild(self, specs: list[TenantSpec]) -> None:
        """A new sharded policy of `specs`, the kept tenants' state carried over (module docstring)."""
        start_s = time.perf_counter()
        old, kept, pending = self.sharded, {}, set()
        if old is not None:
            kept = {spec.name: old.tenant_state(spec.name) for spec in specs if spec.name in old.tenants}
            pending = old._pending & set(kept)
        self.sharded = old = None
        gc.collect()  # the old model's memory, before the new base loads
        self.specs = list(specs)
        if specs:
            base, self.base = self.base if self.base is not None else load_model(self.model_dir, self.dtype), None
            self.sharded = ShardedTenantPolicy(base, specs, self.ctx, pad_id=self.pad_id,
                                               batch_invariant=self.batch_invariant)
            self.sharded.pass_tokens = self.pass_tokens
            for name, state in kept.items():
                self.sharded.set_tenant_state(name, state)
            self.sharded._pending = pending
        self.rebuild_seconds.append(time.perf_counter() - start_s)

    def _forward_backward(self, header: dict, datums: Sequence[Datum]) -> list[DatumResult]:
        """This data-parallel rank's share of `datums` on its shard; every datum's results on every rank."""
        dp, rank, n = self.ctx.dp_size, self.ctx.dp_rank, len(datums)
        start, end = rank * n // dp, (rank + 1) * n // dp
        mine = self._sharded().forward_backward(datums[start:end], header["loss"], backward=header["backward"],
                                                config=header["config"])
        widths = [len(datum.tokens) for datum in datums]  # a loss, then len(tokens) - 1 log-probs, each
        offsets = [0]
        for width in widths:
            offsets.append(offsets[-1] + width)
        flat = [0.0] * offsets[-1]
        if self.ctx.rank % self.ctx.tp == 0:  # one rank of each TP group adds its share
            for i, result in zip(range(start, end), mine):
                flat[offsets[i]:offsets[i + 1]] = [result.loss, *result.logprobs]
        flat = self.ctx.sum(flat)
        return [DatumResult(flat[offsets[i]], flat[offsets[i] + 1:offsets[i + 1]]) for i in range(n)]

    def _set_state(self, header: dict, tensors: list[torch.Tensor]) -> None:
        """A set_tenant_state command's tensors (float64 on the wire) back in their shapes and dtypes."""
        whole = [t.to(getattr(torch, dtype)).reshape(shape) for t, (shape, dtype) in zip(tensors, header["layout"])]
        names = header["names"]
        moments: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
        for (name, key), tensor in zip(header["moments"], whole[len(names):]):
            moments[name][key] = tensor
        state = TenantState(dict(zip(names, whole)), {name: None for name in names}, moments)
        self._sharded().set_tenant_state(header["tenant"], state)

    def _probe(self, tenant: str, probe: list[int]) -> bool:
        model = self._sharded().model
        with routed(model, torch.zeros((1, len(probe)), dtype=torch.long, device=self.ctx.device), [tenant]):
            finite = probe_logits_finite(model, probe)
        reshard(model)  # no backward follows: drop the root unit's whole weights now
        return finite


def _datums(header: dict, tensors: list[torch.Tensor]) -> list[Datum]:
    """The datums a forward_backward command carries."""
    lengths, tokens, values = (t.tolist() for t in tensors)
    datums, at, at_value = [], 0, 0
    for tenant, length, keys in zip(header["tenants"], lengths, header["keys"]):
        inputs = {}
        for key in keys:
            inputs[key] = values[at_value:at_value + length - 1]
            at_value += length - 1
        datums.append(Datum(tenant, tokens[at:at + length], inputs))
        at += length
    return datums


def _spec(header: dict) -> TenantSpec:
    spec = header["spec"]
    modules = spec["target_modules"]
    return TenantSpec(**{**spec, "target_modules": tuple(modules) if isinstance(modules, list) else modules})


# What a rank > 0 runs for each command (its results are rank 0's).
_FOLLOW: dict[str, Callable[[RankedTenantPolicy, dict, list[torch.Tensor]], Any]] = {
    "add": lambda policy, header, _: policy._rebuild([*policy.specs, _spec(header)]),
    "remove": lambda policy, header, _: policy._rebuild([s for s in policy.specs if s.name != header["tenant"]]),
    "forward_backward": lambda policy, header, tensors: policy._forward_backward(header, _datums(header, tensors)),
    "optim_step": lambda policy, header, _: policy._sharded().optim_step(header["tenant"], AdamParams(**header["adam"])),
    "tenant_state": lambda policy, header, _: policy._sharded().tenant_state(header["tenant"]),
    "full_parameters": lambda policy, header, _: policy._sharded().full_parameters(header["tenant"]),
    "logprobs": lambda policy, header, tensors: policy._sharded().logprobs(
        header["tenant"], tensors[0][:header["prompt"]].tolist(), tensors[0][header["prompt"]:].tolist()),
    "probe": lambda policy, header, tensors: policy._probe(header["tenant"], tensors[0].tolist()),
    "set_tenant_state": lambda policy, header, tensors: policy._set_state(header, tensors),
}


class RankedSource(TenantSource):
    """Rank 0's `TenantSource` of a `RankedTenantPolicy`'s tenant: its factors gathered whole, its
    forwards run on every rank (module docstring: no swap)."""

    def _live(self) -> dict[str, torch.Tensor]:
        # On the model thread, which rebuilds run on too: the model that `adapter` reads its config and
        # dtype from is the one these factors come from (another tenant's create may be rebuilding it
        # while this source is made on the event loop).
        self.model = self._policy.model
        return self._policy.full_parameters(self.tenant)

    def _as_published(self, read):
        self._snapshot()
        return read()

    def probe_logits_finite(self, probe: Sequence[int]) -> bool:
        return self._policy.probe_logits_finite(self.tenant, probe)


def serve_on_ranks(args, model_dir: Callable[[], Path], serve: Callable[[Path, RankedTenantPolicy], None]) -> None:
    """`graft tenants serve` on torchrun's ranks: rank 0 resolves the base (`model_dir()`, which may
    fetch it) before the others, builds its `RankedTenantPolicy` and runs `serve(base, policy)`, then
    stops the others; ranks > 0 follow. Ranks > 0 end at once on Ctrl-C (their wait for a command is
    one collective, which Python's own handler would not interrupt)."""
    import signal

    from graft.models.loading import load_tokenizer
    from graft.parallel.dist import init_distributed, shutdown_distributed

    ctx = init_distributed(tp=args.tp)
    try:
        found = model_dir() if ctx.is_main else None
        ctx.barrier()
        found = found or model_dir()
        policy = RankedTenantPolicy(found, ctx, dtype=args.dtype, pad_id=load_tokenizer(found).pad_token_id or 0,
                                    pass_tokens=args.pass_tokens, batch_invariant=args.batch_invariant)
        if not ctx.is_main:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            policy.follow()
            return
        try:
            serve(found, policy)
        finally:
            try:
                policy.release_followers()
            except RuntimeError as error:  # torchrun's SIGTERM ended them already
                log.info("the other ranks are gone already: %s", error)
    finally:
        shutdown_distributed(ctx)
