"""Small pieces shared by the HTTP engine clients (vLLM, SGLang) and the pool: the one sender with
its retry policy, the one mapping from a refused call to graft's typed errors, and task helpers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    BadRequestError,
    EngineError,
    EngineHealth,
    EngineUnavailableError,
    EngineUnreachableError,
    UnknownAdapterError,
)

T = TypeVar("T")


def server_message(text: str) -> str:
    """The server's own words from an error body, whichever shape it has: `{"error": {"message"}}`
    (vLLM's OpenAI errors), `{"error": "..."}` (vLLM's dev endpoints), `{"error_message"}` (SGLang),
    `{"message"}`, `{"detail"}` (FastAPI), or plain text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for value in (error, body.get("error_message"), body.get("message"), body.get("detail")):
            if isinstance(value, str) and value:
                return value
            if value:
                return json.dumps(value)
    return text.strip()


async def settle(task: asyncio.Future) -> None:
    """Cancel `task` if it still runs, wait for it and mark its outcome read. A task that failed in
    the loop pass in which its waiter was cancelled is otherwise reported at exit as "Task exception
    was never retrieved", with a traceback under the run's one error line (seen when a killed vLLM
    server failed every request at once). A finished task is read at once, without a loop pass:
    this runs after every answered generation."""
    if task.done():
        if not task.cancelled():
            task.exception()
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def gather_cancel_on_error(coros: Iterable[Awaitable[Any]]) -> list[Any]:
    """`asyncio.gather` in input order; when one fails, the siblings are cancelled (not orphaned)
    and awaited, then the failure is re-raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# How long an idle pooled connection may be reused. vLLM's and SGLang's servers (uvicorn) close a
# connection idle for 5 s, httpx's default expiry is also 5 s: a request sent on a connection at that
# instant meets the server's close and fails with ReadError('') though the server never read it (seen
# once on an adapter load in `graft bench e2e`, max_staleness 1, SmolLM2). Expiring first avoids it.
KEEPALIVE_EXPIRY_S = 2.0


async def send(http: httpx.AsyncClient, method: str, path: str, *, address: str, retries: int, backoff_s: float,
               timeout_s: float, **kwargs: Any) -> httpx.Response:
    """One HTTP request with the engine clients' retry policy; the response whatever its status.

    Only a failure to *connect* (refused, reset or timed out while connecting) is retried, `retries`
    times with exponential backoff from `backoff_s`: the request never reached the server, so a
    retry is safe even for calls that are not idempotent (an adapter load); and a GET whose
    connection the server closed. A timeout or a connection lost after sending may mean the server
    did the work (or is wedged), so it is raised at once as `EngineUnavailableError`.
    """
    for attempt in range(retries + 1):
        try:
            return await http.request(method, path, timeout=timeout_s, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            if attempt == retries:
                raise EngineUnreachableError(f"{method} {path}: cannot connect after {attempt + 1} attempt(s): "
                                             f"{error!r}", address=address) from error
        except httpx.TimeoutException as error:
            raise EngineUnavailableError(f"{method} {path}: no answer within {timeout_s:g} s ({error!r})",
                                         address=address) from error
        except (httpx.ReadError, httpx.RemoteProtocolError) as error:
            # A pooled connection the server closed: uvicorn closes one after a route raised (vLLM 0.20's
            # adapter routes raise where later versions answer an error). A GET is safe to send again.
            if method != "GET" or attempt == retries:
                raise EngineUnavailableError(f"{method} {path}: {error!r}", address=address) from error
        except httpx.TransportError as error:  # e.g. the server died mid-request
            raise EngineUnavailableError(f"{method} {path}: {error!r}", address=address) from error
        await asyncio.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")


def error_class_for_status(status: int) -> type[EngineError]:
    """The typed error of an HTTP error status when the server's words name no adapter problem:
    the server refused this request (4xx) or cannot serve now (5xx; 429 too: it is transient)."""
    if status >= 500 or status == 429:
        return EngineUnavailableError
    if 400 <= status < 500:
        return BadRequestError
    return EngineError


@dataclass(frozen=True)
class AdapterWords:
    """An adapter problem an engine tells only in its words: any of `phrases` in the message (at
    `status`, or any status when None; compared in lower case when `fold_case`) means `error`."""

    error: type[EngineError]
    phrases: tuple[str, ...]
    status: int | None = None
    fold_case: bool = False

    def match(self, status: int, words: str) -> bool:
        text = words.lower() if self.fold_case else words
        return (self.status is None or self.status == status) and any(p in text for p in self.phrases)


# Each engine's words for adapter problems, by `rollout.engine` name; the first match wins.
ADAPTER_WORDS: dict[str, tuple[AdapterWords, ...]] = {
    # vLLM: "The model `x` does not exist." / "... cannot be found" (404), "... has already been loaded" (400). Its
    # 404 "No adapter found for <path>" (a bad load path) matches neither: a BadRequestError by status.
    "vllm": (AdapterWords(UnknownAdapterError, ("does not exist", "cannot be found"), status=404),
             AdapterWords(AdapterAlreadyLoadedError, ("already been loaded",), status=400)),
    # SGLang (lora_registry.py, tokenizer_communicator_mixin.py): "... because it is already loaded", "LoRA with
    # name X does not exist", at whatever status the route answers.
    "sglang": (AdapterWords(AdapterAlreadyLoadedError, ("already loaded", "already exists"), fold_case=True),
               AdapterWords(UnknownAdapterError, ("does not exist", "never been loaded", "are not loaded"),
                            fold_case=True)),
}


def error_for(engine: str, status: int, words: str, *, address: str, route: str | None = None) -> EngineError:
    """The typed error for a call `engine` refused with HTTP `status` and the server's `words`: an
    adapter problem when the words say so (`ADAPTER_WORDS`), else by status.

    `route`: the call, put before the words as "<route> -> HTTP <status>: " (SGLang's messages do
    not say which call they answer; vLLM's are kept as they are).
    """
    error = next((rule.error for rule in ADAPTER_WORDS[engine] if rule.match(status, words)), None)
    cls = error or error_class_for_status(status)
    message = words if route is None else f"{route} -> HTTP {status}: {words or '(empty body)'}"
    return cls(message, address=address, status=status)


async def answer_while_alive(call: Awaitable[T], health: Callable[[], Awaitable[EngineHealth]], *, every_s: float,
                             address: str) -> T:
    """`call`'s answer; while it is unanswered, the server's `health()` is asked every `every_s`.

    A generation on a live server may take as long as its request timeout (one step of 64 x 256
    tokens at the Qwen2.5-0.5B shape took minutes on one vLLM-CPU thread); a frozen or dead
    server fails it within `every_s` + one health call instead.

    Raises:
        EngineUnavailableError: the health check failed while `call` was unanswered (`call` is cancelled).
    """
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            status = await health()
            if not status.healthy:
                raise EngineUnavailableError(f"no answer to a generation for {every_s:g} s, then the health "
                                             f"check failed: {status.detail}", address=address)
    finally:
        await settle(task)
