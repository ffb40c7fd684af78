"""Tinker API requests read into graft's values, every field and size checked when parsed.

What a client sends is checked here, before anything is queued: a datum whose token ids are outside
the vocabulary or whose loss inputs are missing is refused as its own request's 400, so it never
reaches a forward pass it would share with other users' datums. Each refusal names the field or the
limit (the `graft tenants serve` flag that sets it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from graft.rollout.engine import SamplingParams
from graft.tenants.fields import Fields
from graft.tenants.futures import RequestFailed
from graft.tenants.losses import LOSSES, loss_config
from graft.tenants.policy import AdamParams, Datum
from graft.tenants.users import Limits
from graft.tenants.wire import ForwardBackwardRequest, WireDatum

DEFAULT_MAX_TOKENS = 256  # a sample request that names none (the SDK omits None)


@dataclass(frozen=True)
class Bounds:
    """What the base model takes (its vocabulary, its context) and the service's limits."""

    vocab_size: int
    context_tokens: int
    limits: Limits

    @classmethod
    def of(cls, base, limits: Limits) -> Bounds:
        """The bounds of the base model `base` (a transformers model) under `limits`."""
        context = getattr(base.config, "max_position_embeddings", None) or 1 << 20
        return cls(base.get_input_embeddings().num_embeddings, int(context), limits)

    @property
    def datum_tokens(self) -> int:
        return min(self.context_tokens, self.limits.datum_tokens or self.context_tokens)

    def check_tokens(self, tokens: Sequence[int], what: str) -> None:
        """Every id of `tokens` in the vocabulary."""
        bad = next((token for token in tokens if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise RequestFailed(f"{what}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")


def forward_payload(tenant: str, wire: ForwardBackwardRequest, bounds: Bounds) -> dict:
    """A forward_backward's datums for `tenant`, its loss and the loss's whole config, checked."""
    if wire.loss_fn not in LOSSES:
        raise RequestFailed(f"unknown loss_fn {wire.loss_fn!r} (losses: {', '.join(LOSSES)})")
    if not wire.data:
        raise RequestFailed("forward_backward needs at least one datum")
    try:
        config = loss_config(wire.loss_fn, wire.loss_fn_config)
    except ValueError as error:
        raise RequestFailed(str(error)) from None
    datums = [datum_of(tenant, datum, index, bounds) for index, datum in enumerate(wire.data)]
    needs = LOSSES[wire.loss_fn][1]
    for index, datum in enumerate(datums):
        if missing := [key for key in needs if key not in datum.inputs]:
            raise RequestFailed(f"datum {index}: loss {wire.loss_fn!r} needs loss_fn_inputs {missing}")
    total = sum(len(datum.tokens) for datum in datums)
    if total > bounds.limits.request_tokens:
        raise RequestFailed(f"the request holds {total} tokens, over the limit of {bounds.limits.request_tokens} "
                            "per forward_backward (--max-request-tokens); send fewer datums per call")
    return {"datums": datums, "loss": wire.loss_fn, "config": config, "forward_only": wire.forward_only}


def datum_of(tenant: str, wire: WireDatum, index: int, bounds: Bounds) -> Datum:
    """A Tinker datum as graft's: Tinker scores `target_tokens[i]` at input position i, which must be
    the next input token (the SDK's recipes build them so); graft keeps the sequence once, inputs + the
    last target, with one value per scored position.

    Raises:
        RequestFailed: targets that are not the inputs shifted by one, per-position inputs of another
            length or not finite, token ids outside the vocabulary, or more tokens than a datum may hold.
    """
    count = len(wire.tokens)
    if count + 1 > bounds.datum_tokens:
        raise RequestFailed(f"datum {index}: {count + 1} tokens, over the limit of {bounds.datum_tokens} per datum "
                            "(the base's context, or --max-datum-tokens)")
    target = wire.inputs.get("target_tokens")
    if target is None or len(target.shape) != 1 or target.shape[0] != count or count == 0:
        raise RequestFailed(f"datum {index}: loss_fn_inputs needs 'target_tokens', one per input token ({count})")
    if list(target.values[:-1]) != list(wire.tokens[1:]):
        raise RequestFailed(f"datum {index}: target_tokens must be model_input shifted by one (target i = "
                            "input token i + 1), as the cookbook's datums are")
    tokens = [*wire.tokens, int(target.values[-1])]
    bounds.check_tokens(tokens, f"datum {index}")
    inputs = {}
    for key, tensor in wire.inputs.items():
        if key == "target_tokens":
            continue
        if tensor.shape != (count,):
            raise RequestFailed(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(tensor.shape)}, "
                                f"need [{count}] (one value per input token)")
        inputs[key] = [float(value) for value in tensor.values]
        if not all(math.isfinite(value) for value in inputs[key]):
            raise RequestFailed(f"datum {index}: loss_fn_inputs[{key!r}] holds a value that is not finite")
    return Datum(tenant, tokens, inputs)


def checkpoint_name(name) -> str:
    """A checkpoint's name as the client gave it: one path segment, not hidden."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name.startswith(".") \
            or len(name) > 255:
        raise RequestFailed(f"a checkpoint name must be one path segment (no '/', not starting with '.', at most "
                            f"255 characters), got {name!r:.80}")
    return name


def lora_settings(data: Fields) -> dict:
    """The SDK's `LoraConfig` (rank, seed, train_attn, train_mlp; train_unembed accepted, unused); the
    service checks the rank against what its engine serves."""
    lora = data.object("lora_config")
    lora.flag("train_unembed", True)
    return {"rank": lora.integer("rank", 32), "seed": lora.integer("seed", None, low=0),
            "train_attn": lora.flag("train_attn", True), "train_mlp": lora.flag("train_mlp", True)}


def adam_params(data: Fields) -> AdamParams:
    """The SDK's `AdamParams` (sent as `adam_params`); unknown keys refused, each value a finite number."""
    adam = data.object("adam_params")
    known = AdamParams.__dataclass_fields__
    if unknown := sorted(set(adam.keys()) - set(known)):
        raise RequestFailed(f"adam_params: unknown keys {unknown} (known: {', '.join(known)})")
    return AdamParams(**{key: adam.number(key, low=0.0) for key in adam.keys()})


def sampling_params(data: Fields, bounds: Bounds, prompt_length: int) -> SamplingParams:
    """The SDK's `SamplingParams` (and `num_samples`) as graft's engine takes them, within the limits."""
    count = data.integer("num_samples", 1, low=1, high=bounds.limits.sample_tokens)
    params = data.object("sampling_params")
    max_tokens = params.integer("max_tokens", DEFAULT_MAX_TOKENS, low=1, high=bounds.context_tokens)
    if count * max_tokens > bounds.limits.sample_tokens:
        raise RequestFailed(f"num_samples x max_tokens = {count * max_tokens}, over the limit of "
                            f"{bounds.limits.sample_tokens} per sample request (--max-sample-tokens)")
    if prompt_length + max_tokens > bounds.context_tokens:
        raise RequestFailed(f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) is over the base's "
                            f"context of {bounds.context_tokens} tokens")
    stop = _stop(params, bounds)
    return SamplingParams(n=count, temperature=params.number("temperature", 1.0, low=0.0),
                          top_p=params.number("top_p", 1.0, low=1e-9, high=1.0), max_new_tokens=max_tokens,
                          stop=tuple(s for s in stop or () if isinstance(s, str)),
                          stop_token_ids=tuple(s for s in stop or () if isinstance(s, int)),
                          seed=params.integer("seed", None), ignore_eos=stop == [],
                          top_k=max(params.integer("top_k", -1, low=-1, high=bounds.vocab_size), 0))


def _stop(params: Fields, bounds: Bounds) -> list[str | int] | None:
    """The SDK's `stop`: a string, stop strings or stop token ids (None: stop at end-of-sequence; []:
    never stop before max_tokens)."""
    raw = params.raw("stop")
    if raw is None:
        return None
    stop = [params.text("stop")] if not isinstance(raw, list) else params.items("stop")
    if len(stop) > 64:
        raise RequestFailed(f"{len(stop)} stops, over the limit of 64")
    if all(isinstance(item, str) and len(item) <= 256 for item in stop):
        return stop
    if all(isinstance(item, int) and not isinstance(item, bool) for item in stop):
        bounds.check_tokens(stop, "sampling_params.stop")
        return stop
    raise RequestFailed("field 'sampling_params.stop' must be a string, a list of strings (each at most 256 "
                        "characters) or a list of token ids")


def prompt_tokens(data: Fields, bounds: Bounds) -> list[int]:
    """The prompt's token ids: its encoded_text chunks, each id in the vocabulary."""
    tokens = []
    for index, chunk in enumerate(data.object("prompt").items("chunks")):
        chunk = Fields(chunk, f"prompt.chunks[{index}].")
        if chunk.text("type", "encoded_text") != "encoded_text":
            raise RequestFailed("only encoded_text prompt chunks are supported")
        for token in chunk.items("tokens"):
            if isinstance(token, bool) or not isinstance(token, int):
                raise RequestFailed(f"prompt.chunks[{index}].tokens: token ids must be integers")
            tokens.append(token)
        if len(tokens) > bounds.context_tokens:
            raise RequestFailed(f"the prompt is longer than the base's context of {bounds.context_tokens} tokens")
    bounds.check_tokens(tokens, "prompt")
    return tokens
