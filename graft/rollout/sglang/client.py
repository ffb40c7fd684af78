"""`SglangClient`: the rollout engine protocol over SGLang's native HTTP API. EXPERIMENTAL.

Tested three ways: against a real SGLang 0.5.23 server on this CPU machine (`make sglang-venv`;
`tests/rollout/sglang/test_client_live.py`, docs/sglang-cpu.md), against answers recorded from that
server, and against a fake server that replays the shapes in `tests/rollout/sglang/shapes.py`.

The shapes were first read from SGLang's own source (github.com/sgl-project/sglang); versions
differ, so the files and commits are named here (the recordings confirmed them, plus `rid` and
`http_worker_ipc` in LoRA answers and an `{"error": "<string>"}` body for a malformed request):

- `python/sglang/srt/entrypoints/http_server.py` @ 0025436eab0556737d615b36a4dd3e1e26e82f3d: the
  routes `/generate`, `/load_lora_adapter`, `/unload_lora_adapter`, `/update_weights_from_disk`,
  `/flush_cache`, `/health`; error bodies `{"error": {"message": ...}}` (ValueError, 400) and
  `{"object": "error", "message", "type", "param", "code"}` (HTTPException and request validation).
- `python/sglang/srt/managers/io_struct.py` @ 001067fffe33427bee0ed2f007fb7551a1d76b44:
  `GenerateReqInput` (`input_ids`, `sampling_params`, `return_logprob`, `lora_path`; `n` > 1 turns a
  single prompt into a batch of n), `LoadLoRAAdapterReqInput` {`lora_name`, `lora_path`},
  `UnloadLoRAAdapterReqInput` {`lora_name`}, `LoRAUpdateOutput` {`success`, `error_message`,
  `loaded_adapters`}, `UpdateWeightFromDiskReqInput` {`model_path`, `load_format`, ...,
  `flush_cache`=True}.
- `python/sglang/srt/managers/tokenizer_manager.py` @ 001067ff...: the response dict {`text`,
  `output_ids`, `meta_info`}, `meta_info.output_token_logprobs` as `[logprob, token_id, text|None]`
  triples, `meta_info.finish_reason` as `{"type": "stop"|"length"|"abort", ...}`, parallel
  sampling (n outputs, one list), and `_resolve_lora_path`.
- `python/sglang/srt/managers/tokenizer_communicator_mixin.py` @ 00096b5f4aa0a995aa1e076e43239bc5cf6fbdd0
  and `python/sglang/srt/lora/lora_registry.py` @ 0270cffc14bfddbaa85d1c844d584feb47951abf: the
  adapter error messages ("... because it is already loaded", "LoRA with name X does not exist").
- `python/sglang/srt/sampling/sampling_params.py` @ 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03:
  `temperature`, `top_p`, `top_k`, `max_new_tokens`, `stop`, `stop_token_ids`, `n`, `ignore_eos`,
  `sampling_seed`.

Behaviours of SGLang this client accounts for:
- SGLang selects a LoRA by its loaded *name*, passed as `lora_path` in `/generate`.
- SGLang keeps the path of every adapter it ever loaded and silently re-loads an unloaded one when a
  request names it (`_resolve_lora_path`). A stale policy must never generate, so this client refuses
  (UnknownAdapterError, nothing sent) to generate with a name it unloaded itself.
- With `n` > 1 SGLang copies one `sampling_params` dict to every sample, so one `sampling_seed`
  would give n identical samples; seeded requests are therefore sent as a batch of n prompts with
  seeds `seed + i`. Unseeded requests use SGLang's own parallel sampling (`n`).
- There is no route that lists adapters; `list_adapters` reports `loaded_adapters` from the last
  load/unload answer (which also reflects SGLang's own LRU evictions).
- `/flush_cache` answers plain text, 400 while requests are running or waiting.
- The returned log-probs are of the temperature-scaled distribution unless the server runs with
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (then before temperature; measured). graft's launcher sets it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from graft.rollout.api_key import auth_headers, raise_if_unauthorized
from graft.rollout.engine import (
    BadRequestError,
    Completion,
    EngineError,
    EngineHealth,
    GenerateRequest,
    UnknownAdapterError,
)
from graft.rollout.http_util import KEEPALIVE_EXPIRY_S, error_for, gather_cancel_on_error, send, server_message

_FINISH_REASONS = ("stop", "length")
_RETRY_BASE_S = 0.2
_FLUSH_TRIES, _FLUSH_WAIT_S = 20, 0.25  # a weight update's cache flush, retried while requests drain


# --- request building (pure) -------------------------------------------------------------------


def build_generate_payload(request: GenerateRequest, adapter: str | None) -> dict[str, Any]:
    """The `/generate` body for one request: token ids in, log-probs of the sampled tokens out.

    n == 1 is a single prompt; n > 1 without a seed uses SGLang's parallel sampling
    (`sampling_params.n`); n > 1 with a seed is a batch of n copies of the prompt with seeds
    `seed + i`, because SGLang would give every parallel sample the same seed.
    """
    p = request.params
    sampling: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p,
                                "max_new_tokens": p.max_new_tokens, "ignore_eos": p.ignore_eos}
    if p.stop:
        sampling["stop"] = list(p.stop)
    if p.top_k:
        sampling["top_k"] = p.top_k
    if p.stop_token_ids:
        sampling["stop_token_ids"] = list(p.stop_token_ids)
    prompt = list(request.prompt_token_ids)
    payload: dict[str, Any] = {"input_ids": prompt, "return_logprob": True}
    if p.n == 1:
        payload["sampling_params"] = sampling if p.seed is None else {**sampling, "sampling_seed": p.seed}
    elif p.seed is None:
        payload["sampling_params"] = {**sampling, "n": p.n}
    else:
        payload["input_ids"] = [prompt] * p.n
        payload["sampling_params"] = [{**sampling, "sampling_seed": p.seed + i} for i in range(p.n)]
    if adapter is not None:
        payload["lora_path"] = adapter  # a loaded adapter's name; SGLang broadcasts it over a batch
    return payload


def build_load_payload(name: str, path: str) -> dict[str, Any]:
    """The `/load_lora_adapter` body (`LoadLoRAAdapterReqInput`)."""
    return {"lora_name": name, "lora_path": path}


def build_unload_payload(name: str) -> dict[str, Any]:
    """The `/unload_lora_adapter` body (`UnloadLoRAAdapterReqInput`)."""
    return {"lora_name": name}


def build_update_weights_payload(path: str) -> dict[str, Any]:
    """The `/update_weights_from_disk` body (`UpdateWeightFromDiskReqInput`)."""
    return {"model_path": path}


# --- response parsing (pure) -------------------------------------------------------------------


def parse_output(out: dict[str, Any], *, address: str = "") -> Completion:
    """One SGLang output dict -> Completion.

    Raises:
        EngineError: On an aborted generation or a body without per-token log-probs.
    """
    try:
        meta = out["meta_info"]
        reason = meta["finish_reason"]
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in _FINISH_REASONS:
            raise EngineError(f"/generate ended with finish_reason {reason!r}", address=address)
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise EngineError("/generate answer has no meta_info.output_token_logprobs", address=address)
        token_ids = tuple(int(t[1]) for t in triples)
        logprobs = tuple(float(t[0]) for t in triples)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineError(f"malformed /generate output ({exc!r}): {str(out)[:300]}", address=address) from exc
    output_ids = out.get("output_ids")
    if output_ids is not None and tuple(output_ids) != token_ids:
        raise EngineError(f"output_ids {output_ids} disagree with output_token_logprobs ids {list(token_ids)}",
                          address=address)
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=kind, text=out.get("text") or "")


def parse_generate_response(body: Any, n: int, *, address: str = "") -> list[Completion]:
    """A `/generate` answer (one dict for one sample, a list of n dicts for n) -> n Completions."""
    outputs = [body] if isinstance(body, dict) else body
    if not isinstance(outputs, list) or len(outputs) != n:
        raise EngineError(f"/generate answered {len(outputs) if isinstance(outputs, list) else type(body).__name__}"
                          f" outputs, expected {n}", address=address)
    return [parse_output(out, address=address) for out in outputs]


def parse_lora_update(body: Any, status: int, *, address: str, route: str) -> dict[str, str] | None:
    """A `LoRAUpdateOutput` answer -> `loaded_adapters` {name: path} (None if absent).

    Raises:
        AdapterAlreadyLoadedError, UnknownAdapterError, BadRequestError, EngineError: `success` false.
    """
    if not isinstance(body, dict) or "success" not in body:
        raise EngineError(f"{route}: unexpected answer {str(body)[:300]}", address=address, status=status)
    if not body["success"]:
        raise error_for("sglang", status, str(body.get("error_message") or ""), address=address, route=route)
    return body.get("loaded_adapters")


def _updated_but_not_flushed(body: Any) -> bool:
    """SGLang's answer when it updated the weights but kept the prefix cache (requests were running)."""
    message = str(body.get("message", "")).lower() if isinstance(body, dict) else ""
    return "weights were updated" in message and "not flushed" in message


def check_weights_update(body: Any, status: int, *, address: str) -> None:
    """An `/update_weights_from_disk` answer {success, message, num_paused_requests}.

    Raises:
        EngineError: `success` false, with SGLang's message.
    """
    if not isinstance(body, dict) or not body.get("success"):
        words = body.get("message", "") if isinstance(body, dict) else str(body)
        raise error_for("sglang", status, str(words), address=address, route="/update_weights_from_disk")


# --- the client --------------------------------------------------------------------------------


class SglangClient:
    """`RolloutEngine` over one SGLang server's native API (launched with `--enable-lora`).

    Args:
        base_url: e.g. "http://127.0.0.1:30000"; also this engine's `address`.
        max_concurrency: `/generate` calls in flight at once.
        request_timeout_s: Timeout of a `/generate` and of a weight update (connect, read, write).
        control_timeout_s: Timeout of every other call. Keep it above 20 s: SGLang's /health runs
            a 1-token generation and waits up to 20 s for it.
        connect_retries: Retries after a refused/timed-out *connection* (nothing was sent, so a
            retry cannot apply a call twice), with exponential backoff from 0.2 s.
        api_key: Sent as `Authorization: Bearer <key>` (SGLang's `--api-key`); None sends nothing.
    """

    def __init__(self, base_url: str, *, max_concurrency: int = 64, request_timeout_s: float = 300.0,
                 control_timeout_s: float = 30.0, connect_retries: int = 3, api_key: str | None = None) -> None:
        if max_concurrency < 1 or min(request_timeout_s, control_timeout_s) <= 0 or connect_retries < 0:
            raise ValueError(f"need max_concurrency >= 1, timeouts > 0, connect_retries >= 0 (got {max_concurrency}, "
                             f"{request_timeout_s}, {control_timeout_s}, {connect_retries})")
        self.base_url = base_url.rstrip("/")
        self.address = self.base_url
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_retries = connect_retries
        self._headers = auth_headers(api_key)
        self._loaded: dict[str, str] = {}  # name -> path, as SGLang last reported it
        self._unloaded: set[str] = set()  # names this client unloaded (SGLang would re-load them)
        # httpx clients and asyncio semaphores bind to the event loop that first uses them.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"SglangClient({self.address!r})"

    async def __aenter__(self) -> SglangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections (a later call opens new ones)."""
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = self._slots = self._loop = None

    # -- RolloutEngine ------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        """One `/generate` per request, at most `max_concurrency` at once, answers in input order.

        Raises:
            UnknownAdapterError: `adapter` was unloaded by this client, or SGLang does not know it.
            EngineUnavailableError, BadRequestError, EngineError: as SGLang answered.
        """
        if adapter is not None and adapter in self._unloaded:
            raise UnknownAdapterError(f"adapter {adapter!r} was unloaded; SGLang would silently re-load it "
                                      "from its old path, so it is not requested", address=self.address)
        return await gather_cancel_on_error(self._generate_one(r, adapter) for r in requests)

    async def load_adapter(self, name: str, path: str) -> None:
        """`/load_lora_adapter`. Raises AdapterAlreadyLoadedError, BadRequestError (e.g. LoRA not
        enabled, rank too large), EngineUnavailableError."""
        status, body = await self._call("POST", "/load_lora_adapter", build_load_payload(name, path))
        loaded = parse_lora_update(body, status, address=self.address, route="/load_lora_adapter")
        self._loaded = dict(loaded) if loaded is not None else {**self._loaded, name: path}
        self._unloaded.discard(name)

    async def unload_adapter(self, name: str) -> None:
        """`/unload_lora_adapter` (SGLang waits for running requests on it). Raises UnknownAdapterError."""
        status, body = await self._call("POST", "/unload_lora_adapter", build_unload_payload(name))
        loaded = parse_lora_update(body, status, address=self.address, route="/unload_lora_adapter")
        self._loaded = dict(loaded) if loaded is not None else {k: v for k, v in self._loaded.items() if k != name}
        self._unloaded.add(name)

    async def list_adapters(self) -> list[str]:
        """Adapters SGLang reported loaded in its last load/unload answer (SGLang has no list route)."""
        return sorted(self._loaded)

    async def reload_weights(self, path: str) -> None:
        """`/update_weights_from_disk` then `/flush_cache`; call it while no generation is running
        (SGLang refuses to flush the prefix cache while requests are running or waiting).

        Raises:
            EngineError (typed by status): either step failed, with SGLang's message.
        """
        status, body = await self._call("POST", "/update_weights_from_disk", build_update_weights_payload(path),
                                        timeout_s=self.request_timeout_s)
        if not _updated_but_not_flushed(body):  # that one the flush below finishes
            check_weights_update(body, status, address=self.address)
        for attempt in range(_FLUSH_TRIES):
            try:
                await self._call("POST", "/flush_cache")
                return
            except BadRequestError as exc:
                # SGLang refuses while requests are running or waiting: a request that was finishing
                # (or being aborted) when the update came drains in well under a second.
                if attempt == _FLUSH_TRIES - 1:
                    raise EngineError(f"weights updated from {path} but the prefix cache was NOT flushed (SGLang "
                                      f"refuses while requests are running or waiting, still after "
                                      f"{_FLUSH_TRIES * _FLUSH_WAIT_S:.0f} s): {exc.server_message}",
                                      address=self.address, status=exc.status) from exc
                await asyncio.sleep(_FLUSH_WAIT_S)

    async def health(self) -> EngineHealth:
        """`GET /health` (SGLang generates one token); unhealthy with the reason instead of raising."""
        try:
            await self._call("GET", "/health", retries=0)
        except EngineError as exc:
            return EngineHealth(self.address, False, tuple(sorted(self._loaded)), str(exc))
        return EngineHealth(self.address, True, tuple(sorted(self._loaded)))

    # -- HTTP ---------------------------------------------------------------------------------

    async def _generate_one(self, request: GenerateRequest, adapter: str | None) -> list[Completion]:
        async with self._ensure_loop_state()[1]:
            _, body = await self._call("POST", "/generate", build_generate_payload(request, adapter),
                                       timeout_s=self.request_timeout_s)
        return parse_generate_response(body, request.params.n, address=self.address)

    def _ensure_loop_state(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._http is None or self._slots is None:
            # trust_env=False: loopback servers must not be reached through an http_proxy.
            self._http = httpx.AsyncClient(base_url=self.base_url, trust_env=False, headers=self._headers,
                                           limits=httpx.Limits(max_connections=self.max_concurrency,
                                                               keepalive_expiry=KEEPALIVE_EXPIRY_S))
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        return self._http, self._slots

    async def _call(self, method: str, route: str, payload: dict[str, Any] | None = None, *,
                    timeout_s: float | None = None, retries: int | None = None) -> tuple[int, Any]:
        """Send one call (under the control timeout unless `timeout_s`); return (status, JSON body
        or text) for 2xx, raise the typed error otherwise. LoRA routes answer 400 with a
        `success: false` body, which their parser turns into the adapter-specific error, so those
        bodies are returned rather than raised here."""
        response = await self._send(method, route, payload, timeout_s or self.control_timeout_s,
                                    self.connect_retries if retries is None else retries)
        raise_if_unauthorized(response, address=self.address, sent_key=bool(self._headers))
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        if response.status_code < 400:
            return response.status_code, body
        if response.status_code == 400 and isinstance(body, dict) and "success" in body:
            return response.status_code, body
        raise error_for("sglang", response.status_code, server_message(response.text), address=self.address,
                        route=f"{method} {route}")

    async def _send(self, method: str, route: str, payload: dict[str, Any] | None, timeout_s: float,
                    retries: int) -> httpx.Response:
        http, _ = self._ensure_loop_state()
        return await send(http, method, route, address=self.address, retries=retries, backoff_s=_RETRY_BASE_S,
                          timeout_s=timeout_s, json=payload)
