"""The Tinker API over HTTP: the routes the `tinker` SDK's training and sampling clients call,
translated to and from `graft.tenants.service.TenantService`.

Transport rules the SDK holds a server to (its 0.38.0 sources): JSON bodies except forward_backward
requests and the forward_backward / sample results, which are protobuf (graft.tenants.wire); every
operation answers at once with a request id and its result is fetched with `retrieve_future`;
metric keys are `name:reduction`; an error carries a non-empty body (the SDK retries an empty 400 as
a proxy's). The service asks the SDK for its plain HTTP transport and no token exchange, so
`X-API-Key` carries the key itself on every request.

Every request names its user by its key (graft.tenants.users) and acts on that user's things only.
A retried request (the SDK resends with the same `X-Idempotency-Key` after a lost answer) gets the
first answer again, not a second operation; answers are remembered per user and route, so a key
sent by another user or to another route is a new request. A body over the limit is refused
unread (413); every field is checked when parsed (graft.tenants.parse), each refusal one 4xx line.
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

from graft.tenants.fields import Fields
from graft.tenants.futures import RequestFailed, TooLarge, TooMany
from graft.tenants.operations import LOAD_STATE, OPTIM_STEP, SAVE_FOR_SAMPLER, SAVE_STATE
from graft.tenants.parse import (
    Bounds,
    adam_params,
    checkpoint_name,
    forward_payload,
    lora_settings,
    prompt_tokens,
    sampling_params,
)
from graft.tenants.rest import Listing, page
from graft.tenants.sampling import SampleResult
from graft.tenants.schedule import FORWARD_BACKWARD, ForwardResult
from graft.tenants.users import Users
from graft.tenants.wire import (
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
_REMEMBERED_ANSWERS = 4096  # idempotency keys kept, newest


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
    """The route handlers over one `TenantService`; `guarded` adds what every route shares (the
    user's key, the body's size, idempotent retries, a refused request's one-line 4xx). Each handler
    takes the request and its user."""

    def __init__(self, service, users: Users, poll_seconds: float) -> None:
        self.service, self.users, self.poll_seconds = service, users, poll_seconds
        self.answers: OrderedDict[tuple[str, str, str], Response] = OrderedDict()  # (user, route, key) -> answer
        self.bounds: Bounds = service.bounds
        self.listing = Listing(service)

    def guarded(self, path: str, handler: Callable[[Request, str], Awaitable[Response]], method: str = "POST") -> Route:
        async def endpoint(request: Request) -> Response:
            user = self.users.user_of(request.headers.get("x-api-key"))
            if user is None:
                return JSONResponse({"detail": "missing or unknown API key (X-API-Key)"}, status_code=401)
            remembered = (user, path, request.headers.get("x-idempotency-key") or "")
            if remembered[2] and remembered in self.answers:
                return self.answers[remembered]
            try:
                response = await handler(request, user)
            except (RequestFailed, WireError) as error:
                status = getattr(error, "status", 400)
                log.warning("%s of %s refused (%d): %s", path, user, status, str(error))  # not the error: its frames
                response = JSONResponse({"detail": str(error)}, status_code=status)
            except Exception:  # a fault of the service's: the details (maybe its directories) go to its log only
                log.exception("%s of %s failed", path, user)
                return JSONResponse({"detail": "internal error; the service's log has the details"}, status_code=500)
            if remembered[2] and path != "/retrieve_future" and response.status_code != 429:
                self.answers[remembered] = response
                while len(self.answers) > _REMEMBERED_ANSWERS:
                    self.answers.popitem(last=False)
            return response
        return Route("/api/v1" + path, endpoint, methods=[method])

    async def raw(self, request: Request) -> bytes:
        """The body, refused unread past the limit (413): a declared length is checked first, then the
        bytes as they arrive, so a body that lies about its length is cut off too."""
        limit = self.service.limits.body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"the request body is {int(declared)} bytes, over the limit of {limit} (--max-body-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the request body is over the limit of {limit} bytes (--max-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def body(self, request: Request) -> Fields:
        raw = await self.raw(request)
        try:
            return Fields(json.loads(raw) if raw else {})
        except (ValueError, RecursionError):
            raise RequestFailed("the request body is not valid JSON") from None

    def _room(self, user: str) -> None:
        """Refuse a new operation (429: the SDK waits and sends it again) while `user` has the limit
        of operations in flight."""
        limit = self.service.limits.pending_per_user
        if self.service.futures.pending[user] >= limit:
            raise TooMany(f"you have {limit} requests in flight, the limit per user (--max-pending)")

    @staticmethod
    def future(request_id: str, **extra) -> JSONResponse:
        return JSONResponse({"request_id": request_id, **extra})

    def ordered(self, user: str, ids: tuple[str, int] | Fields, kind: str, payload: Callable[[], object]
                ) -> JSONResponse:
        """A model's operation, queued at its place in the model's order (`ids`: the model id and seq_id,
        or the fields holding them); a request refused (its `payload()` raises) still gives up its
        place, or the model's later operations would wait for it. A 429 keeps it: the SDK sends it again."""
        model_id, seq_id = ids if isinstance(ids, tuple) else (ids.text("model_id"), ids.integer("seq_id", low=0))
        self.service.model(user, model_id)
        self._room(user)
        try:
            made = payload()
        except Exception:
            self.service.skip(user, model_id, seq_id)
            raise
        return self.future(self.service.submit(user, model_id, seq_id, kind, made), model_id=model_id)

    async def heartbeat(self, request: Request, user: str) -> Response:
        if self.service.heartbeat(user, (await self.body(request)).text("session_id")):
            return JSONResponse({"type": "session_heartbeat"})
        return JSONResponse({"detail": "the session is finished"}, status_code=410)  # the SDK stops beating

    async def create_session(self, request: Request, user: str) -> Response:
        await self.body(request)  # tags and metadata: read and checked, not kept
        return JSONResponse({"session_id": self.service.create_session(user), "type": "create_session"})

    async def finish_session(self, request: Request, user: str) -> Response:
        await self.service.finish_session(user, request.path_params["session_id"])
        return JSONResponse({})

    async def create_model(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        self._room(user)
        return self.future(self.service.create_model(
            user, data.text("session_id"), data.integer("model_seq_id", 0, low=0), data.text("base_model"),
            **lora_settings(data)))

    async def get_info(self, request: Request, user: str) -> Response:
        return JSONResponse(self.service.info(user, (await self.body(request)).text("model_id")))

    async def forward_backward(self, request: Request, user: str) -> Response:
        wire = decode_forward_backward(await self.raw(request))
        return self.ordered(user, (wire.model_id, wire.seq_id), FORWARD_BACKWARD, lambda: forward_payload(
            self.service.model(user, wire.model_id).tenant, wire, self.bounds))

    async def optim_step(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        return self.ordered(user, data, OPTIM_STEP, lambda: adam_params(data))

    async def save_for_sampler(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        return self.ordered(user, data, SAVE_FOR_SAMPLER,
                            lambda: None if "path" not in data else checkpoint_name(data.text("path")))

    async def save_state(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        return self.ordered(user, data, SAVE_STATE, lambda: {
            "name": checkpoint_name(data.text("path")), "overwrite": data.flag("overwrite")})

    async def load_state(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        if "model_id" not in data:  # create_training_client_from_state: a new model from the state
            self._room(user)
            return self.future(self.service.create_model_from_state(
                user, data.text("session_id"), data.integer("model_seq_id", 0, low=0), data.text("path"),
                data.flag("optimizer")))
        return self.ordered(user, data, LOAD_STATE,
                            lambda: {"path": data.text("path"), "optimizer": data.flag("optimizer")})

    async def create_sampler(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        sampler_id = self.service.create_sampler(user, data.text("session_id"), data.text("model_path", None),
                                                 data.text("base_model", None))
        return JSONResponse({"sampling_session_id": sampler_id})

    async def get_sampler(self, request: Request, user: str) -> Response:
        sampler_id = request.path_params["sampler_id"]
        adapter = self.service.sampling.adapter(user, sampler_id)
        return JSONResponse({"sampler_id": sampler_id, "base_model": self.service.base_model, "model_path": adapter})

    async def sample(self, request: Request, user: str) -> Response:
        data = await self.body(request)
        self._room(user)
        prompt = prompt_tokens(data, self.bounds)
        request_id, sequence_ids = self.service.sampling.sample(
            user, data.text("sampling_session_id"), prompt, sampling_params(data, self.bounds, len(prompt)),
            data.flag("prompt_logprobs"))
        return self.future(request_id, sample_sequence_ids=sequence_ids)

    async def training_runs(self, request: Request, user: str) -> Response:
        runs, cursor = page(self.listing.runs(user), Fields(dict(request.query_params)), 20)
        return JSONResponse({"training_runs": [self.listing.run(user, run) for run in runs], "cursor": cursor})

    async def training_run(self, request: Request, user: str) -> Response:
        return JSONResponse(self.listing.run(user, request.path_params["run"]))

    async def run_checkpoints(self, request: Request, user: str) -> Response:
        run = request.path_params["run"]
        self.listing.run(user, run)  # unknown (or another user's): 404
        return JSONResponse({"checkpoints": self.listing.checkpoints(user, run)})

    async def user_checkpoints(self, request: Request, user: str) -> Response:
        every = [c for run in self.listing.runs(user) for c in self.listing.checkpoints(user, run)]
        listed, cursor = page(every, Fields(dict(request.query_params)), 100)
        return JSONResponse({"checkpoints": listed, "cursor": cursor})

    async def delete_checkpoint(self, request: Request, user: str) -> Response:
        self.listing.delete(user, request.path_params["run"], request.path_params["checkpoint"])
        return JSONResponse({})

    async def sessions(self, request: Request, user: str) -> Response:
        owned = [session_id for session_id, session in self.service.sessions.items()
                 if session.owner == user and not session.finished]
        listed, _ = page(owned, Fields(dict(request.query_params)), 20)
        return JSONResponse({"sessions": listed})

    async def session(self, request: Request, user: str) -> Response:
        session = self.service.user_session(user, request.path_params["session_id"])
        return JSONResponse({"training_run_ids": session.models, "sampler_ids": []})

    async def retrieve(self, request: Request, user: str) -> Response:
        request_id = (await self.body(request)).text("request_id")
        result = await self.service.futures.wait(user, request_id, self.poll_seconds)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return encoded_result(result)


def _answer(value: dict) -> Callable[[Request, str], Awaitable[Response]]:
    """A handler that always answers `value`."""
    async def handler(request: Request, user: str) -> Response:
        return JSONResponse(value)
    return handler


def build_app(service, users: Users, *, poll_seconds: float = 25.0) -> Starlette:
    """The service's HTTP application. `users`: whose keys a request's `X-API-Key` may carry;
    `poll_seconds`: how long `retrieve_future` holds a request for a result not yet there."""
    e = _Endpoints(service, users, poll_seconds)
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
        e.guarded("/training_runs", e.training_runs, "GET"),
        e.guarded("/training_runs/{run}", e.training_run, "GET"),
        e.guarded("/training_runs/{run}/checkpoints", e.run_checkpoints, "GET"),
        e.guarded("/training_runs/{run}/checkpoints/{checkpoint:path}", e.delete_checkpoint, "DELETE"),
        e.guarded("/checkpoints", e.user_checkpoints, "GET"),
        e.guarded("/sessions", e.sessions, "GET"),
        e.guarded("/sessions/{session_id}", e.session, "GET"),
    ])
