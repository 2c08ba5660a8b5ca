"""Server-sent events: framing, and a response that always closes its source.

Starlette cancels the body iterator when the client disconnects; an async
generator suspended at a ``yield`` is then not finalised until garbage
collection. `EventStream` closes the iterator itself, so the generator's
``finally`` (which aborts the request) runs at once, shielded from the
cancellation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    """One SSE `data:` event holding `data` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def parse_events(lines: AsyncIterator[str]) -> AsyncIterator[Any]:
    """JSON payloads of `data:` lines (as from httpx `aiter_lines`), up to `[DONE]`."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200) -> None:
        super().__init__(
            events,
            status_code=status_code,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
