"""`VllmClient`: the `RolloutEngine` protocol over a vLLM OpenAI-compatible server's HTTP API.

A `generate` of several requests is one call to graft's batch route (`/v1/graft/completions`,
added to the servers graft launches: graft.rollout.vllm.server.batch_route) so the engine sees the whole
batch at once and each prompt keeps its own seed; on a server without that route, one
`/v1/completions` call per request (prompt as token ids, `n` samples), run concurrently under one
semaphore per client. Adapters are chosen by the `model` field; base weights are swapped with
`/collective_rpc reload_weights` inside a pause (see shared/notes/vllm-cpu.md for the endpoints'
observed answers). The server must run with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and
`VLLM_SERVER_DEV_MODE=1`, as `VllmServer` starts it.

Log-probs: vLLM reports the sampled token's log-prob under its *raw* distribution
(`logprobs_mode="raw_logprobs"`, before temperature and top-p), which is the policy's log-prob
when temperature == top_p == 1.

Retry policy and error mapping (`graft.rollout.http_util`, shared with the SGLang client): only a failure to
connect is retried, `connect_retries` times with exponential backoff; a timeout, a connection lost
after sending and every HTTP error status are raised at once.

Timeouts: a generation may legitimately take many minutes, so it has its own `request_timeout_s`
(a ceiling); so do the calls that wait for generations or read a whole model (`/pause?mode=wait`,
the weight reload). Every other call (adapters, model list, health, cache reset, resume) answers in
well under a second on a serving server, so `control_timeout_s` can be short and a frozen server is
noticed within it; a generation unanswered for `control_timeout_s` has the server's health checked
(`answer_while_alive`), so a frozen server fails it within twice that, not at the ceiling.

Authentication: with `api_key`, every call carries `Authorization: Bearer <key>`, which vLLM
checks on /v1/* when started with `--api-key` or with VLLM_API_KEY in its environment.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import httpx

from graft.rollout.adapter_blob import SharedBlob
from graft.rollout.api_key import auth_headers, raise_if_unauthorized
from graft.rollout.engine import (
    BadRequestError,
    Completion,
    EngineError,
    EngineHealth,
    GenerateRequest,
    TransportUnsupportedError,
)
from graft.rollout.http_util import (
    KEEPALIVE_EXPIRY_S,
    answer_while_alive,
    error_for,
    gather_cancel_on_error,
    send,
    server_message,
)
from graft.rollout.vllm.server.batch_route import ROUTE as BATCH_ROUTE
from graft.rollout.vllm.server.lora_memory import ROUTE as MEMORY_ROUTE


def completion_payload(request: GenerateRequest, model: str) -> dict:
    """The `/v1/completions` body for one request."""
    p = request.params
    payload = {"model": model, "prompt": list(request.prompt_token_ids), "n": p.n,
               "temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_new_tokens,
               "stop": list(p.stop), "seed": p.seed, "ignore_eos": p.ignore_eos,
               "logprobs": 1, "return_token_ids": True}
    if p.top_k:
        payload["top_k"] = p.top_k
    if p.stop_token_ids:
        payload["stop_token_ids"] = list(p.stop_token_ids)
    return payload


def parse_completions(body: dict, n: int, address: str = "") -> list[Completion]:
    """The `n` completions of one `/v1/completions` response, ordered by `index`.

    Raises:
        EngineError: If the response lacks token ids or per-token log-probs, or they do not pair
            up 1:1 (vLLM pairs `token_logprobs[i]` with `token_ids[i]`; a None marks a missing one).
    """
    choices = sorted(body["choices"], key=lambda c: c["index"])
    if len(choices) != n:
        raise EngineError(f"asked for n={n} completions, got {len(choices)}", address=address)
    completions = []
    for choice in choices:
        token_ids, logprobs = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None or len(token_ids) != len(logprobs) or None in logprobs:
            raise EngineError(f"choice {choice['index']}: token_ids {token_ids} and token_logprobs {logprobs} "
                              "do not pair up (needs `return_token_ids` support, vLLM >= 0.10.2)", address=address)
        completions.append(Completion(token_ids=tuple(token_ids), logprobs=tuple(float(x) for x in logprobs),
                                      finish_reason=choice["finish_reason"], text=choice.get("text") or ""))
    return completions


def base_model_name(models_body: dict) -> str:
    """The served base model's name in a `GET /v1/models` body (the entry without a parent)."""
    bases = [entry["id"] for entry in models_body["data"] if entry.get("parent") is None]
    assert len(bases) == 1, f"expected one base model in /v1/models, got {bases}"
    return bases[0]


def adapter_names(models_body: dict) -> list[str]:
    """The loaded adapters' names in a `GET /v1/models` body (entries with a parent)."""
    return [entry["id"] for entry in models_body["data"] if entry.get("parent") is not None]


def adapter_paths(models_body: dict) -> dict[str, str]:
    """Loaded adapter name -> the path it was loaded from, in a `GET /v1/models` body (vLLM names it `root`)."""
    return {entry["id"]: entry["root"] for entry in models_body["data"]
            if entry.get("parent") is not None and entry.get("root")}


def _naming_path(error: EngineError, path: str | os.PathLike) -> EngineError:
    """`error` again, with `path` appended: vLLM replaces paths in its messages by "<path>"."""
    return type(error)(f"{error.server_message} [path: {path}]", address=error.address, status=error.status)


class VllmClient:
    """A `RolloutEngine` talking to one vLLM server.

    Args:
        base_url: The server, e.g. `http://127.0.0.1:8000`.
        model: The served base model's name; None discovers it once from `GET /v1/models`.
        max_concurrency: Completion requests in flight at once, across all `generate` calls.
        request_timeout_s: Timeout of one generation, and of the pause and reload that wait on
            generations or read a model (connect, read, write and pool wait).
        control_timeout_s: Timeout of every other call (adapters, model list, health).
        connect_retries: Retries after a connection error (the first try not counted).
        retry_backoff_s: First retry delay; doubled for each further retry.
        api_key: Sent as `Authorization: Bearer <key>` (vLLM's `--api-key`); None sends nothing.
        transport: An httpx transport to use instead of the network (tests, instrumentation).

    Example:
        async with VllmClient(server.url) as client:
            completions_P = await client.generate(requests, adapter="policy-v3")
    """

    def __init__(self, base_url: str, *, model: str | None = None, max_concurrency: int = 64,
                 request_timeout_s: float = 1800, control_timeout_s: float = 30, connect_retries: int = 3,
                 retry_backoff_s: float = 0.5, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if max_concurrency < 1 or connect_retries < 0:
            raise ValueError(f"max_concurrency must be >= 1 and connect_retries >= 0 "
                             f"(got {max_concurrency}, {connect_retries})")
        self.address = base_url.rstrip("/")
        self._model = model
        self._connect_retries = connect_retries
        self._retry_backoff_s = retry_backoff_s
        self._request_timeout_s = request_timeout_s
        self._control_timeout_s = control_timeout_s
        self._sends_key = bool(api_key)
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._batch_route: bool | None = None  # whether the server has graft's batch route; None: not asked yet
        # Headroom over the semaphore for adapter/health calls made while generating.
        limits = httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8,
                             keepalive_expiry=KEEPALIVE_EXPIRY_S)
        # trust_env=False: loopback requests must not go through an http_proxy from the environment.
        self._http = httpx.AsyncClient(base_url=self.address, timeout=request_timeout_s, limits=limits,
                                       headers=auth_headers(api_key), trust_env=False, transport=transport)

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, *, retries: int | None = None, long: bool = False,
                    **kwargs) -> httpx.Response:
        """One HTTP call (`long`: under the request timeout, else the control timeout); a 2xx
        response, or a typed `EngineError`."""
        response = await send(self._http, method, path, address=self.address,
                              timeout_s=self._request_timeout_s if long else self._control_timeout_s,
                              retries=self._connect_retries if retries is None else retries,
                              backoff_s=self._retry_backoff_s, **kwargs)
        raise_if_unauthorized(response, address=self.address, sent_key=self._sends_key)
        if response.status_code >= 400:
            raise error_for("vllm", response.status_code, server_message(response.text), address=self.address)
        return response

    async def base_model(self) -> str:
        """The served base model's name (discovered from `GET /v1/models` on first use)."""
        if self._model is None:
            self._model = base_model_name((await self._call("GET", "/v1/models")).json())
        return self._model

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        """For each request, `params.n` completions (ordered by index) from the base model or `adapter`.

        vLLM seeds sample i of a request with `seed + i`, so requests whose seeds are closer than
        `n` share samples (measured: seed=1 sample 1 == seed=2 sample 0); space seeds by >= n.

        Raises:
            UnknownAdapterError: `adapter` is not loaded ("The model `x` does not exist.").
            BadRequestError: E.g. prompt + max_new_tokens longer than the server's max_model_len.
            EngineUnavailableError: Unreachable server, timeout or 5xx.
        """
        model = adapter if adapter is not None else await self.base_model()
        if len(requests) > 1 and self._batch_route is not False:
            answers = await self._generate_batch([completion_payload(r, model) for r in requests])
            if answers is not None:
                return [parse_completions(body, r.params.n, self.address) for body, r in zip(answers, requests)]

        async def one(request: GenerateRequest) -> list[Completion]:
            async with self._semaphore:
                response = await answer_while_alive(
                    self._call("POST", "/v1/completions", long=True, json=completion_payload(request, model)),
                    self.health, every_s=self._control_timeout_s, address=self.address)
            return parse_completions(response.json(), request.params.n, self.address)

        return await gather_cancel_on_error(one(r) for r in requests)

    async def prompt_logprobs(self, prompt: Sequence[int], adapter: str | None = None) -> list[float | None]:
        """The log-prob of each token of `prompt` under the base model or `adapter`, None at position 0
        (nothing predicts it): vLLM's `prompt_logprobs=0`, which reports each actual prompt token (not
        the top-1), with one token generated (vLLM generates at least one).

        Raises:
            UnknownAdapterError, BadRequestError, EngineUnavailableError: as `generate`.
        """
        model = adapter if adapter is not None else await self.base_model()
        body = {"model": model, "prompt": list(prompt), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
        async with self._semaphore:
            response = await answer_while_alive(self._call("POST", "/v1/completions", long=True, json=body),
                                                self.health, every_s=self._control_timeout_s, address=self.address)
        scored = response.json()["choices"][0].get("prompt_logprobs") or []
        if len(scored) != len(prompt):
            raise EngineError(f"asked for the log-probs of {len(prompt)} prompt tokens, got {len(scored)}",
                              address=self.address)
        return [None if at is None else float(at[str(token)]["logprob"]) for token, at in zip(prompt, scored)]

    async def _generate_batch(self, payloads: list[dict]) -> list[dict] | None:
        """Every payload in one call to graft's batch route (graft.rollout.vllm.server.batch_route), so the
        engine schedules the whole batch at once with each prompt's own seed; None when the server
        has no such route (a vLLM not started by graft), remembered for later calls."""
        async with self._semaphore:
            try:
                response = await answer_while_alive(
                    self._call("POST", BATCH_ROUTE, long=True, json={"requests": payloads}),
                    self.health, every_s=self._control_timeout_s, address=self.address)
            except EngineError as error:
                if error.status == 404 and error.server_message == "Not Found":  # the route, not a model
                    self._batch_route = False
                    return None
                raise
        self._batch_route = True
        return response.json()["responses"]

    async def load_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Load the PEFT adapter at `path` (as the server sees it) under `name`.

        Raises:
            AdapterAlreadyLoadedError: `name` is taken.
            BadRequestError: No adapter at `path` (404 "No adapter found for <path>": vLLM
                sanitizes paths out of its messages, so every error here gets `path` appended).
            EngineUnavailableError: Unreachable, or a 5xx (vLLM answers 500 when the adapter
                exists but cannot be loaded, e.g. a rank above --max-lora-rank).
        """
        try:
            await self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        except EngineError as error:
            if error.status == 404 and error.server_message == "Not Found":  # the route itself is missing
                raise BadRequestError("this vLLM server does not accept runtime LoRA adapters: start it with "
                                      "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (graft serve and "
                                      "graft's launcher do)", address=self.address, status=404) from error
            raise _naming_path(error, path) from error

    # "http": the blob in the request body; "shm": in a shared-memory segment, for a server on this host.
    memory_transports = ("http", "shm")

    async def load_adapter_blob(self, name: str, label: str, blob: bytes | SharedBlob) -> None:
        """Load the adapter in `blob` (graft.rollout.adapter_blob: bytes go in the request body, a
        segment by name) under `name`, no file written, through graft's memory route
        (graft.rollout.vllm.server.lora_memory). `label` stands where a path would: unique per version.

        Raises:
            TransportUnsupportedError: the server has no memory route (a vLLM not started by graft,
                404) or cannot use it (501), or the segment is not on the server's host.
            AdapterAlreadyLoadedError, BadRequestError, EngineUnavailableError: as `load_adapter`.
        """
        params = {"lora_name": name, "lora_path": label}
        try:
            if isinstance(blob, SharedBlob):
                await self._call("POST", MEMORY_ROUTE, params={**params, "shm": blob.segment})
            else:
                await self._call("POST", MEMORY_ROUTE, params=params, content=blob,
                                 headers={"content-type": "application/octet-stream"})
        except EngineError as error:
            missing = error.status == 404 and error.server_message == "Not Found"
            if missing or error.status == 501 or "no shared-memory segment" in error.server_message:
                raise TransportUnsupportedError(error.server_message if not missing else
                                                "this server has no graft memory route (not started by graft)",
                                                address=self.address, status=error.status) from error
            raise

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`; UnknownAdapterError if it is not loaded."""
        await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def list_adapters(self) -> list[str]:
        return adapter_names((await self._call("GET", "/v1/models")).json())

    async def adapter_paths(self) -> dict[str, str]:
        """Loaded adapter name -> the path it was loaded from (how `graft.sync.owner` finds an
        adapter's run); an optional engine capability, vLLM's alone."""
        return adapter_paths((await self._call("GET", "/v1/models")).json())

    async def reload_weights(self, path: str | os.PathLike) -> None:
        """Replace the base weights with the safetensors model at `path` and reset the prefix cache.

        Order: pause (waiting for in-flight requests) → reload → reset prefix cache → resume. The
        reset is needed: vLLM's reload keeps prefix-cache blocks computed with the old weights.
        Resume runs even when a step fails, so the server is never left paused.
        """
        await self._call("POST", "/pause", long=True, params={"mode": "wait"})
        try:
            try:
                await self._call("POST", "/collective_rpc", long=True,
                                 json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            except EngineError as error:
                raise _naming_path(error, path) from error
            answer = await self._call("POST", "/reset_prefix_cache")
            # vLLM 0.20 answers an empty 200 and says nothing of the outcome; later ones {"success": ...}
            reset = answer.json() if answer.content else {"success": True}
            if reset.get("success") is not True:  # vLLM refuses while blocks are held by requests
                raise EngineError(f"weights reloaded from {path} but the prefix cache was not reset: {reset}",
                                  address=self.address)
        finally:
            await self._call("POST", "/resume")

    async def health(self) -> EngineHealth:
        """`GET /health` and the loaded adapters, without retries; never raises."""
        try:
            await self._call("GET", "/health", retries=0)
            adapters = await self._call("GET", "/v1/models", retries=0)
        except EngineError as error:
            return EngineHealth(address=self.address, healthy=False, detail=str(error))
        return EngineHealth(address=self.address, healthy=True, adapters=tuple(adapter_names(adapters.json())))
