"""Reading a JSON request body with a size limit (413) and clear 400s."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from pdengine.server.errors import APIError


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `max_bytes` (declared or streamed), 400 if malformed."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "Content-Length: not an integer") from None
        if size > max_bytes:
            raise APIError(413, f"request body has {size} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body
