"""Small pieces shared by the HTTP engine clients (vLLM, SGLang) and the pool."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterable
from typing import Any


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
