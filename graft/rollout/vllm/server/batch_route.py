"""`POST /v1/graft/completions`: a whole rollout batch in one HTTP call, each prompt with its own
sampling parameters — added to the vLLM API server graft launches (graft.rollout.vllm.server.entry).

Why: a step's batch sent as one `/v1/completions` call per prompt reaches vLLM's engine in waves
(its one front-end thread parses request after request while the engine is already stepping), and
one `/v1/completions` call carrying every prompt gives every prompt the same seed — vLLM seeds
sample g of each prompt with `seed + g`, so the g-th samples of all prompts would draw the same
random numbers. This route takes a list of ordinary `/v1/completions` bodies and hands them to
vLLM's own completion handler together, in one event-loop pass, so the engine sees the batch at
once and every prompt keeps its seed. Measured on 2 cores (hidden 128, 2 layers, 16 prompts x 8
samples x 32 tokens): see `graft bench rollout` and docs/benchmarks.md.

Each body is validated and served exactly as `/v1/completions` serves it (same model / adapter
resolution, log-probs, token ids); the answer is `{"responses": [<CompletionResponse>...]}` in
order, or the first error with its status. The path is under `/v1`, so vLLM's API-key check
applies to it.
"""

import asyncio
from collections.abc import Callable
from typing import Any

from graft.rollout.vllm.server.versions import api_server_module

ROUTE = "/v1/graft/completions"


def add_batch_route(app) -> None:
    """Register `ROUTE` on vLLM's FastAPI `app`."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse

    @app.post(ROUTE)
    async def completions_batch(raw_request: Request):
        body = await raw_request.json()
        bodies = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(bodies, list) or not bodies:
            return _error(400, "expected a JSON object {\"requests\": [<completion request>, ...]} with at least one")
        try:
            requests = [CompletionRequest.model_validate(b) for b in bodies]
        except ValidationError as error:
            return _error(400, str(error))
        if any(r.stream for r in requests):
            return _error(400, "streaming is not supported in a batch")
        handler = raw_request.app.state.openai_serving_completion
        answers = await _unless_disconnected(
            asyncio.gather(*(handler.create_completion(r, raw_request) for r in requests)), raw_request)
        if answers is None:  # the client is gone: nobody reads an answer
            return None
        for answer in answers:
            if not isinstance(answer, CompletionResponse):  # an ErrorResponse
                return JSONResponse(content=answer.model_dump(), status_code=answer.error.code)
        return JSONResponse(content={"responses": [a.model_dump() for a in answers]})

    def _error(status: int, message: str):
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": "BadRequestError",
                                                                   "code": status}})


async def _unless_disconnected(work: asyncio.Future, raw_request) -> Any:
    """`work`'s result, or None once the client disconnects: then `work` is cancelled, which aborts
    its requests in the engine, as vLLM's own routes do (`with_cancellation`, which cannot wrap this
    route: it reads the body itself). Why: a stopped trainer leaves its batch in flight, and a
    handler still awaiting it held the server's shutdown — measured on SmolLM2-135M, a SIGTERM'd
    server whose engine had been stopped waited on its 8 requests until SIGKILL 20 s later."""
    async def disconnected() -> None:  # the body was read: only a disconnect can come now
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not work.done()
        if gone:
            work.cancel()
            work.add_done_callback(lambda done: done.cancelled() or done.exception())  # read: not logged as lost
    return None if gone else work.result()


def patch_build_app(add_route: Callable[[Any], None]) -> None:
    """Make vLLM's API server entry build its app with `add_route(app)` applied (each patch once)."""
    entry = api_server_module()
    build_app = entry.build_app

    def build_app_with_route(*args, **kwargs):
        app = build_app(*args, **kwargs)
        add_route(app)
        return app

    entry.build_app = build_app_with_route
