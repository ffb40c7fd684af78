"""The Tinker API over HTTP: the routes the `tinker` SDK's training and sampling clients call,
translated to and from `graft.tenants.service.TenantService`.

Transport rules the SDK holds a server to (its 0.38.0 sources): JSON bodies except forward_backward
requests and the forward_backward / sample results, which are protobuf (graft.tenants.wire); every
operation answers at once with a request id and its result is fetched with `retrieve_future`;
metric keys are `name:reduction`; an error carries a non-empty body (the SDK retries an empty 400 as
a proxy's). The service asks the SDK for its plain HTTP transport and no token exchange, so
`X-API-Key` carries the key itself on every request.

A retried request (the SDK resends with the same `X-Idempotency-Key` after a lost answer) gets the
first answer again, not a second operation.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from graft.rollout.engine import SamplingParams
from graft.tenants.futures import RequestFailed
from graft.tenants.policy import AdamParams, Datum
from graft.tenants.sampling import SampleResult
from graft.tenants.service import (
    FORWARD_BACKWARD,
    LOAD_STATE,
    OPTIM_STEP,
    SAVE_FOR_SAMPLER,
    SAVE_STATE,
    ForwardResult,
)
from graft.tenants.wire import (
    WireDatum,
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)

log = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                 "sample_join_sampling_session": False}
DEFAULT_MAX_TOKENS = 256  # a sample request that names none (the SDK omits None)
_REMEMBERED_ANSWERS = 4096  # idempotency keys kept, newest


class _Fields(dict):
    """A request's JSON fields: a missing one is the client's error, named."""

    def __missing__(self, key: str):
        raise RequestFailed(f"missing field {key!r}")


def datum_of(tenant: str, wire: WireDatum, index: int) -> Datum:
    """A Tinker datum as graft's: Tinker scores `target_tokens[i]` at input position i, which must be
    the next input token (the SDK's recipes build them so); graft keeps the sequence once, inputs + the
    last target, with one value per scored position.

    Raises:
        RequestFailed: targets that are not the inputs shifted by one, or per-position inputs of
            another length.
    """
    count = len(wire.tokens)
    target = wire.inputs.get("target_tokens")
    if target is None or len(target.shape) != 1 or target.shape[0] != count:
        raise RequestFailed(f"datum {index}: loss_fn_inputs needs 'target_tokens', one per input token ({count})")
    if list(target.values[:-1]) != list(wire.tokens[1:]):
        raise RequestFailed(f"datum {index}: target_tokens must be model_input shifted by one (target i = "
                            "input token i + 1), as the cookbook's datums are")
    inputs = {}
    for key, tensor in wire.inputs.items():
        if key == "target_tokens":
            continue
        if tensor.shape != (count,):
            raise RequestFailed(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(tensor.shape)}, "
                                f"need [{count}] (one value per input token)")
        inputs[key] = [float(value) for value in tensor.values]
    return Datum(tenant, [*wire.tokens, int(target.values[-1])], inputs)


def _name(name) -> str:
    """A checkpoint's name as the client gave it: one path segment."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise RequestFailed(f"a checkpoint name must be one non-empty path segment without '/', got {name!r}")
    return name


def sampling_params(body: dict) -> SamplingParams:
    """The SDK's `SamplingParams` (and `num_samples`) as graft's engine takes them."""
    params, count = body.get("sampling_params") or {}, int(body.get("num_samples", 1))
    if params.get("top_k", -1) not in (-1, 0):
        raise RequestFailed(f"top_k {params['top_k']} is not supported; use -1 (no top-k)")
    stop = params.get("stop")
    if stop is not None and not isinstance(stop, list):
        stop = [stop]
    if stop and not all(isinstance(item, str) for item in stop):
        raise RequestFailed("stop token ids are not supported; give stop strings (or none: stop at end-of-sequence)")
    try:
        return SamplingParams(n=count, temperature=float(params.get("temperature", 1.0)),
                              top_p=float(params.get("top_p", 1.0)),
                              max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
                              stop=tuple(stop or ()), seed=params.get("seed"), ignore_eos=stop == [])
    except ValueError as error:
        raise RequestFailed(f"sampling_params: {error}") from error


def prompt_tokens(body: dict) -> list[int]:
    chunks = (body.get("prompt") or {}).get("chunks") or []
    if any(chunk.get("type", "encoded_text") != "encoded_text" for chunk in chunks):
        raise RequestFailed("only encoded_text prompt chunks are supported")
    return [int(token) for chunk in chunks for token in chunk.get("tokens", [])]


def encoded_result(result) -> Response:
    """A finished future's result as the SDK expects it: protobuf for forward and sample results."""
    if isinstance(result, RequestFailed):
        return JSONResponse({"error": str(result), "category": result.category})
    if isinstance(result, ForwardResult):
        outputs = [{"logprobs": datum.logprobs} for datum in result.datums]
        return Response(encode_forward_backward_output(outputs, {"loss:sum": result.loss}), media_type=PROTOBUF)
    if isinstance(result, SampleResult):
        sequences = [(list(c.token_ids), list(c.logprobs), "length" if c.finish_reason == "length" else "stop")
                     for c in result.completions]
        return Response(encode_sample_response(sequences, result.prompt_logprobs), media_type=PROTOBUF)
    return JSONResponse(result)


class _Endpoints:
    """The route handlers over one `TenantService`; `guarded` adds what every route shares (the API
    key, idempotent retries, a refused request's one-line 400)."""

    def __init__(self, service, api_keys: set[str], poll_seconds: float) -> None:
        self.service, self.api_keys, self.poll_seconds = service, api_keys, poll_seconds
        self.answers: OrderedDict[str, Response] = OrderedDict()  # by idempotency key, newest last

    def guarded(self, path: str, handler: Callable[[Request], Awaitable[Response]], method: str = "POST") -> Route:
        async def endpoint(request: Request) -> Response:
            if request.headers.get("x-api-key") not in self.api_keys:
                return JSONResponse({"detail": "missing or unknown API key (X-API-Key)"}, status_code=401)
            key = request.headers.get("x-idempotency-key")
            if key is not None and key in self.answers:
                return self.answers[key]
            try:
                response = await handler(request)
            except (RequestFailed, WireError, ValueError, TypeError) as error:
                log.warning("%s refused: %s", path, error)
                response = JSONResponse({"detail": str(error)}, status_code=400)
            if key is not None and path != "/retrieve_future":
                self.answers[key] = response
                while len(self.answers) > _REMEMBERED_ANSWERS:
                    self.answers.popitem(last=False)
            return response
        return Route("/api/v1" + path, endpoint, methods=[method])

    @staticmethod
    async def body(request: Request) -> dict:
        raw = await request.body()
        fields = json.loads(raw) if raw else {}
        if not isinstance(fields, dict):
            raise RequestFailed("the request body must be a JSON object")
        return _Fields(fields)

    @staticmethod
    def future(request_id: str, **extra) -> JSONResponse:
        return JSONResponse({"request_id": request_id, **extra})

    def ordered(self, model_id: str, seq_id: int, kind: str, payload: Callable[[], object]) -> JSONResponse:
        """A model's operation, queued at its place in the model's order; a request refused (its
        `payload()` raises) still gives up its place, or the model's later operations would wait for it."""
        try:
            made = payload()
        except Exception:
            self.service.skip(model_id, int(seq_id))
            raise
        return self.future(self.service.submit(model_id, int(seq_id), kind, made), model_id=model_id)

    async def heartbeat(self, request: Request) -> Response:
        if self.service.heartbeat((await self.body(request))["session_id"]):
            return JSONResponse({"type": "session_heartbeat"})
        return JSONResponse({"detail": "the session is finished"}, status_code=410)  # the SDK stops beating

    async def create_session(self, request: Request) -> Response:
        return JSONResponse({"session_id": self.service.create_session(), "type": "create_session"})

    async def finish_session(self, request: Request) -> Response:
        await self.service.finish_session(request.path_params["session_id"])
        return JSONResponse({})

    async def create_model(self, request: Request) -> Response:
        data = await self.body(request)
        return self.future(self.service.create_model(data["session_id"], int(data.get("model_seq_id", 0)),
                                                     data["base_model"], data.get("lora_config") or {}))

    async def get_info(self, request: Request) -> Response:
        return JSONResponse(self.service.info((await self.body(request))["model_id"]))

    async def forward_backward(self, request: Request) -> Response:
        wire = decode_forward_backward(await request.body())

        def payload() -> dict:
            tenant = self.service.model(wire.model_id).tenant
            if wire.loss_fn_config:
                raise RequestFailed(f"loss_fn_config is not supported (got {sorted(wire.loss_fn_config)})")
            datums = [datum_of(tenant, datum, index) for index, datum in enumerate(wire.data)]
            return {"datums": datums, "loss": wire.loss_fn, "forward_only": wire.forward_only}

        return self.ordered(wire.model_id, wire.seq_id, FORWARD_BACKWARD, payload)

    async def optim_step(self, request: Request) -> Response:
        data = await self.body(request)
        return self.ordered(data["model_id"], data["seq_id"], OPTIM_STEP, lambda: AdamParams(
            **{key: float(value) for key, value in (data.get("adam_params") or {}).items()}))

    async def save_for_sampler(self, request: Request) -> Response:
        data = await self.body(request)
        return self.ordered(data["model_id"], data["seq_id"], SAVE_FOR_SAMPLER,
                            lambda: None if data.get("path") is None else _name(data["path"]))

    async def save_state(self, request: Request) -> Response:
        data = await self.body(request)
        return self.ordered(data["model_id"], data["seq_id"], SAVE_STATE,
                            lambda: {"name": _name(data.get("path")), "overwrite": bool(data.get("overwrite"))})

    async def load_state(self, request: Request) -> Response:
        data = await self.body(request)
        if "model_id" not in data:  # create_training_client_from_state: a new model from the state
            return self.future(self.service.create_model_from_state(
                data["session_id"], int(data.get("model_seq_id", 0)), data["path"], bool(data.get("optimizer"))))
        return self.ordered(data["model_id"], data["seq_id"], LOAD_STATE,
                            lambda: {"path": data["path"], "optimizer": bool(data.get("optimizer"))})

    async def create_sampler(self, request: Request) -> Response:
        data = await self.body(request)
        sampler_id = self.service.create_sampler(data["session_id"], data.get("model_path"), data.get("base_model"))
        return JSONResponse({"sampling_session_id": sampler_id})

    async def get_sampler(self, request: Request) -> Response:
        sampler_id = request.path_params["sampler_id"]
        adapter = self.service.sampling.adapter(sampler_id)
        return JSONResponse({"sampler_id": sampler_id, "base_model": self.service.base_model, "model_path": adapter})

    async def sample(self, request: Request) -> Response:
        data = await self.body(request)
        request_id, sequence_ids = self.service.sampling.sample(
            data["sampling_session_id"], prompt_tokens(data), sampling_params(data), bool(data.get("prompt_logprobs")))
        return self.future(request_id, sample_sequence_ids=sequence_ids)

    async def retrieve(self, request: Request) -> Response:
        request_id = (await self.body(request))["request_id"]
        if request_id not in self.service.futures:
            return JSONResponse({"detail": f"unknown request {request_id!r} (or fetched long ago)"},
                                status_code=404)
        result = await self.service.futures.wait(request_id, self.poll_seconds)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return encoded_result(result)


def _answer(value: dict) -> Callable[[Request], Awaitable[Response]]:
    """A handler that always answers `value`."""
    async def handler(request: Request) -> Response:
        return JSONResponse(value)
    return handler


def build_app(service, api_keys: set[str], *, poll_seconds: float = 25.0) -> Starlette:
    """The service's HTTP application. `api_keys`: the keys a request's `X-API-Key` may carry;
    `poll_seconds`: how long `retrieve_future` holds a request for a result not yet there."""
    e = _Endpoints(service, api_keys, poll_seconds)
    capabilities = {"supported_models": [{"model_name": service.base_model, "trainable": True, "sampleable": True}]}
    return Starlette(routes=[
        e.guarded("/client/config", _answer(CLIENT_CONFIG)),
        e.guarded("/client/dynamic_config", _answer({})),
        e.guarded("/session_heartbeat", e.heartbeat),
        e.guarded("/telemetry", _answer({"status": "accepted"})),
        e.guarded("/healthz", _answer({"status": "ok"}), "GET"),
        e.guarded("/get_server_capabilities", _answer(capabilities), "GET"),
        e.guarded("/create_session", e.create_session),
        e.guarded("/sessions/{session_id}/finish", e.finish_session),
        e.guarded("/create_model", e.create_model),
        e.guarded("/get_info", e.get_info),
        e.guarded("/forward_backward", e.forward_backward),
        e.guarded("/optim_step", e.optim_step),
        e.guarded("/save_weights_for_sampler", e.save_for_sampler),
        e.guarded("/save_weights", e.save_state),
        e.guarded("/load_weights", e.load_state),
        e.guarded("/create_sampling_session", e.create_sampler),
        e.guarded("/samplers/{sampler_id}", e.get_sampler, "GET"),
        e.guarded("/asample", e.sample),
        e.guarded("/retrieve_future", e.retrieve),
    ])
