"""The reference rollout engine: transformers + PEFT in this process, with vLLM's semantics.

It exists for fast unit tests and as the log-prob reference the real engines are checked against,
so it does the plainest careful thing: one sample at a time, prefill then one-token decode steps
through the model's own KV cache (`past_key_values`), in the model's dtype (fp32 by default).

Semantics copied from vLLM (v1) so results are comparable:
- `logprobs[i]` is log-softmax of the RAW logits at the sampled token: no temperature, no top-p.
  That is what vLLM returns by default (`logprobs_mode="raw_logprobs"`), and what the trainer's
  teacher-forced forward (`graft.rl.logprobs.sequence_logprobs`) computes.
- temperature below 1e-5 is greedy (argmax, first index on ties); otherwise the token is drawn from
  softmax(logits / temperature) restricted to the top-p nucleus.
- Sample j of a request with `seed` uses a generator seeded with `seed + j` (vLLM seeds the j-th
  child of an n > 1 request so); without a seed the generator is seeded from OS entropy.
- eos = the tokenizer's eos id plus the generation config's `eos_token_id`s; `ignore_eos` ignores
  them (not the request's `stop_token_ids`, which end a sample as eos does, as in vLLM). A sample
  ending on eos keeps the eos token (and its log-prob) in `token_ids`, but its text leaves it out.
  A stop string ends the sample as soon as the decoded text contains it; the token that completed
  it stays in `token_ids` and `text` is cut before the stop string. Both finish with "stop";
  reaching `max_new_tokens` otherwise finishes with "length".
- Text is decoded with the model directory's tokenizer, special tokens skipped.

Adapters live as named adapters of ONE `peft.PeftModel` around the base. PEFT names them with
internal ids (`a0`, `a1`, ...) because its module dicts reject names with dots, which graft's
versioned names may contain; the public name is what the caller sees everywhere.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import peft
import safetensors
import safetensors.torch
import torch

from graft.lora.adapter_io import (
    AdapterError,
    read_adapter_config,
    read_adapter_tensors,
)
from graft.lora.attach import check_target_modules
from graft.lora.export import SAFE_INDEX, SAFE_SINGLE
from graft.models.loading import load_model, load_tokenizer
from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    BadRequestError,
    Completion,
    EngineHealth,
    GenerateRequest,
    SamplingParams,
    UnknownAdapterError,
)

ADDRESS = "in-process"
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: temperatures under it mean greedy


def sample_token(logits_V: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
                 top_k: int = 0) -> int:
    """One token id from raw logits: argmax when temperature < 1e-5, else a draw from
    softmax(logits / temperature) restricted to the `top_k` most probable tokens (0: all), then to
    the top-p nucleus of those (vLLM's order).

    The nucleus is the most probable tokens, in order, up to and including the first one at which
    their mass reaches `top_p`; the top token is always kept, so a tiny top_p is greedy.
    """
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits_V))
    logits_V = logits_V.float()
    if 0 < top_k < logits_V.numel():
        logits_V = logits_V.masked_fill(logits_V < torch.topk(logits_V, top_k).values[-1], float("-inf"))
    probs_V = torch.softmax(logits_V / temperature, dim=-1)
    if top_p < 1.0:
        sorted_V, order_V = probs_V.sort(descending=True)
        mass_before_V = sorted_V.cumsum(0) - sorted_V
        sorted_V[mass_before_V >= top_p] = 0.0
        probs_V = torch.zeros_like(probs_V).scatter_(0, order_V, sorted_V)
    return int(torch.multinomial(probs_V, 1, generator=generator))  # renormalises the kept mass


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device `device` names; "auto" is the GPU when torch sees one, else the CPU.

    Raises:
        ValueError: a CUDA device is asked for and torch sees none (a CPU-only torch, or no GPU).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the reference engine's device is {str(device)!r} but torch sees no CUDA device "
                         "(set rollout.reference_device to 'auto' or 'cpu')")
    return device


class ReferenceEngine:
    """`RolloutEngine` in-process with transformers + PEFT. Async methods compute synchronously.

    Everything the engine computes with lives on `device`: the base, every adapter (PEFT loads it
    there), the prompt ids, the sampling generator; weights read from files (CPU tensors) are moved
    there explicitly. Only token ids and log-probs come back, as Python numbers.

    Args:
        model_path: a local HF model directory (config, safetensors, tokenizer).
        dtype: dtype of the base weights ("float32" by default, the reference precision).
        device: torch device to run on, or "auto" (see `resolve_device`).

    Raises:
        ValueError: see `resolve_device`.
    """

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32",
                 device: str | torch.device = "cpu") -> None:
        self._device = resolve_device(device)
        self._base = load_model(model_path, dtype).to(self._device).eval()
        self._tokenizer = load_tokenizer(model_path)
        self._peft: peft.PeftModel | None = None
        self._adapters: dict[str, str] = {}  # public name -> PEFT adapter name, in load order
        self._ids = itertools.count()
        eos = self._base.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if self._tokenizer.eos_token_id is not None:
            eos.append(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos)

    @property
    def device(self) -> torch.device:
        """Where the engine's weights live and its forwards run."""
        return self._device

    # --- generation -------------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        """`params.n` completions per request from the base (adapter None) or the named adapter.

        Raises:
            UnknownAdapterError: `adapter` is not loaded.
            BadRequestError: an empty prompt, a token id outside the vocabulary, or a prompt plus
                `max_new_tokens` longer than the model's context.
        """
        for request in requests:
            self._check_request(request)
        with self._adapter_active(adapter):
            return [[self._sample(request.prompt_token_ids, request.params, j) for j in range(request.params.n)]
                    for request in requests]

    def _check_request(self, request: GenerateRequest) -> None:
        prompt, config = request.prompt_token_ids, self._base.config
        if not prompt:
            raise BadRequestError("The prompt cannot be empty.", address=ADDRESS, status=400)
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise BadRequestError(f"Token id {bad[0]} is out of vocabulary (size {config.vocab_size}).",
                                  address=ADDRESS, status=400)
        needed = len(prompt) + request.params.max_new_tokens
        if needed > config.max_position_embeddings:
            raise BadRequestError(f"This model's maximum context length is {config.max_position_embeddings} "
                                  f"tokens; the request needs {needed}.", address=ADDRESS, status=400)

    @contextlib.contextmanager
    def _adapter_active(self, adapter: str | None) -> Iterator[None]:
        """Route `self._base`'s forward through `adapter`, or through no adapter at all."""
        if adapter is not None:
            if adapter not in self._adapters:
                raise UnknownAdapterError(f"The model `{adapter}` does not exist.", address=ADDRESS, status=404)
            self._peft.set_adapter(self._adapters[adapter], inference_mode=True)
            yield
        elif self._peft is not None:
            with self._peft.disable_adapter():
                yield
        else:
            yield

    @torch.no_grad()
    def _sample(self, prompt: Sequence[int], params: SamplingParams, index: int) -> Completion:
        """One completion: prefill the prompt, then one forward per new token on the KV cache."""
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed + index)
        out = self._base(input_ids=torch.tensor([list(prompt)], device=self._device), use_cache=True, logits_to_keep=1)
        tokens: list[int] = []
        logprobs: list[float] = []
        text_len = 0
        while True:
            logits_V = out.logits[0, -1]
            token = sample_token(logits_V, params.temperature, params.top_p, generator, params.top_k)
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits_V.float(), dim=-1)[token]))
            if token in params.stop_token_ids or (token in self._eos_ids and not params.ignore_eos):
                return Completion(tuple(tokens), tuple(logprobs), "stop", self._decode(tokens[:-1]))
            if params.stop:
                text = self._decode(tokens)
                cut = _find_stop(text, params.stop, text_len)
                if cut is not None:
                    return Completion(tuple(tokens), tuple(logprobs), "stop", text[:cut])
                text_len = len(text)
            if len(tokens) == params.max_new_tokens:
                return Completion(tuple(tokens), tuple(logprobs), "length", self._decode(tokens))
            out = self._base(input_ids=torch.tensor([[token]], device=self._device),
                             past_key_values=out.past_key_values, use_cache=True)

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    # --- adapters ---------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Validate the PEFT adapter at `path` with graft's strict reader, then add it under `name`.

        Raises:
            AdapterAlreadyLoadedError: `name` is loaded already.
            BadRequestError: `path` is not a usable LoRA adapter for this base (message names the
                path); the engine is left as it was.
        """
        if name in self._adapters:
            raise AdapterAlreadyLoadedError(f"The lora adapter '{name}' has already been loaded.",
                                            address=ADDRESS, status=400)
        try:
            config = read_adapter_config(path)
            tensors = read_adapter_tensors(path)
            check_target_modules(self._base, config.get("target_modules") or [], config.get("exclude_modules") or ())
        except (AdapterError, ValueError) as e:
            raise BadRequestError(f"Loading lora adapter '{name}' from {path} failed: {e}",
                                  address=ADDRESS, status=400) from None
        internal = f"a{next(self._ids)}"
        lora_config = peft.LoraConfig.from_pretrained(str(path))
        lora_config.inference_mode = True
        lora_config.base_model_name_or_path = self._base.name_or_path  # else PEFT warns it renames it
        try:
            if self._peft is None:
                self._peft = peft.get_peft_model(self._base, lora_config, adapter_name=internal)
            else:
                self._peft.add_adapter(internal, lora_config)
            self._peft.load_adapter(str(path), adapter_name=internal, torch_device=str(self._device))
            self._check_loaded(internal, tensors.keys(), path)
        except (AdapterError, ValueError, RuntimeError, KeyError) as e:
            self._drop(internal)
            raise BadRequestError(f"Loading lora adapter '{name}' from {path} failed: {e}",
                                  address=ADDRESS, status=400) from None
        self._adapters[name] = internal

    def _check_loaded(self, internal: str, saved_keys: set[str], path: str | os.PathLike) -> None:
        """PEFT loads non-strictly (missing keys keep their init); require an exact key match."""
        marker = f".{internal}."
        ours = {n.replace(marker, "."): p for n, p in self._peft.named_parameters() if marker in n}
        missing, unexpected = ours.keys() - saved_keys, saved_keys - ours.keys()
        if missing or unexpected:
            raise AdapterError(f"{path}: tensors do not match the base model's LoRA modules "
                               f"(missing: {sorted(missing)[:4]}, unexpected: {sorted(unexpected)[:4]})")

    def _drop(self, internal: str) -> None:
        """Remove PEFT adapter `internal`; the last one takes the LoRA layers with it.

        PEFT cannot delete its last adapter and keep working (a later forward raises KeyError), so
        then the LoRA layers are unloaded (not merged) and the plain base comes back.
        """
        if self._peft is None or internal not in self._peft.peft_config:
            return
        if len(self._peft.peft_config) == 1:
            self._base = self._peft.unload()
            self._peft = None
        else:
            if internal in self._peft.active_adapters:  # else PEFT warns that it picked another one
                self._peft.set_adapter(next(a for a in self._peft.peft_config if a != internal), inference_mode=True)
            self._peft.delete_adapter(internal)

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`. Raises UnknownAdapterError if it is not loaded."""
        if name not in self._adapters:
            raise UnknownAdapterError(f"The model `{name}` does not exist.", address=ADDRESS, status=404)
        self._drop(self._adapters.pop(name))

    async def list_adapters(self) -> list[str]:
        """Names of the adapters loaded now, in load order."""
        return list(self._adapters)

    # --- base weights -----------------------------------------------------------------------------

    async def reload_weights(self, path: str) -> None:
        """Copy the safetensors weights of the model directory `path` into the base, strictly.

        Names are plain HF names (what `graft export` writes); under PEFT the base weights of
        adapted modules sit at `<module>.base_layer.<param>` and are matched to `<module>.<param>`.
        Tensors are cast to the engine's dtype and moved to its device. Adapters stay loaded. Nothing is cached across
        requests here, so there is no prefix cache to drop.

        Raises:
            BadRequestError: no readable safetensors weights at `path`, or a tensor is missing,
                unexpected or of another shape (named). The base is unchanged on error.
        """
        tensors = _read_model_weights(Path(path))
        targets = self._base_tensors()
        provided = {id(targets[k]) for k in tensors.keys() & targets.keys()}
        # a tied weight (lm_head = embed_tokens) is saved once, under one of its names
        missing = sorted(k for k, t in targets.items() if k not in tensors and id(t) not in provided)
        unexpected = sorted(tensors.keys() - targets.keys())
        problem = (f"tensor {missing[0]} is missing ({len(missing)} missing)" if missing
                   else f"unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected)" if unexpected else None)
        for key in sorted(tensors.keys() & targets.keys()):
            if problem is None and tensors[key].shape != targets[key].shape:
                problem = (f"shape mismatch for tensor {key}: {tuple(tensors[key].shape)} in {path}, "
                           f"the engine's model has {tuple(targets[key].shape)}")
        if problem:
            raise BadRequestError(f"Reloading weights from {path} failed: {problem}", address=ADDRESS, status=400)
        with torch.no_grad():
            for key, tensor in tensors.items():
                targets[key].copy_(tensor.to(device=targets[key].device, dtype=targets[key].dtype))

    def _base_tensors(self) -> dict[str, torch.Tensor]:
        """The base model's parameters and persistent buffers under their plain HF names."""
        return {name.replace(".base_layer.", "."): tensor
                for name, tensor in self._base.state_dict(keep_vars=True).items() if ".lora_" not in name}

    async def health(self) -> EngineHealth:
        """Always healthy: the engine is this process."""
        return EngineHealth(address=ADDRESS, healthy=True, adapters=tuple(self._adapters))


def _find_stop(text: str, stops: Sequence[str], checked_len: int) -> int | None:
    """Where the first stop string (in `stops` order, like vLLM) ending after `checked_len` starts."""
    for stop in stops:
        at = text.find(stop, max(0, checked_len - len(stop) + 1))
        if at != -1:
            return at
    return None


def _read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF model directory (`model.safetensors`, or the shards its index lists)."""
    index = path / SAFE_INDEX
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / SAFE_SINGLE).is_file():
            files = [SAFE_SINGLE]
        else:
            raise BadRequestError(f"Reloading weights from {path} failed: no {SAFE_SINGLE} or {SAFE_INDEX} there",
                                  address=ADDRESS, status=400)
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(safetensors.torch.load_file(path / file))
    except (OSError, ValueError, KeyError, safetensors.SafetensorError) as e:
        raise BadRequestError(f"Reloading weights from {path} failed: unreadable weights ({e})",
                              address=ADDRESS, status=400) from None
    return tensors
