"""Worker-to-worker HTTP endpoints: bootstrap (registration), destination pages, heartbeat.

Aborts, failures and abort-acks travel as transport notifications (NIXL), not here.
Every route requires ``Authorization: Bearer <cluster token>``: 401 when the header
is missing or malformed, 403 when the token is wrong (constant-time compare).
A worker only accepts destination pages from a peer that registered
through ``/internal/register`` with the token, so no KV is ever written to an
agent that did not authenticate.

Routes (all JSON):

- ``POST /internal/register`` ``{"peer", "agent_metadata" (base64), "url"?}`` ->
  ``{"peer", "agent_metadata"}`` of this worker (both sides learn each other).
- ``POST /internal/destination`` ``{"room_id", "peer", "dst_pages"}`` -> ``{"ok": true}``.
- ``GET /internal/heartbeat`` -> ``{"ok": true, "peer": <this worker's name>}``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdengine.types import InvalidRequestError, PDEngineError

MAX_ROOM_ID = (1 << 63) - 1


class InternalWorker(Protocol):
    name: str

    def agent_metadata(self) -> bytes: ...

    async def register_peer(
        self, peer: str, agent_metadata: bytes, url: str | None = None
    ) -> None: ...

    def is_registered(self, peer: str) -> bool: ...

    async def add_destination(self, room_id: int, peer: str, dst_pages: list[int]) -> None: ...


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message}}
    if field:
        body["error"]["field"] = field
    return JSONResponse(body, status_code=status)


def _check_token(request: Request, token: str) -> JSONResponse | None:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return _error(401, "missing bearer token (Authorization: Bearer <cluster token>)")
    if not token or not hmac.compare_digest(given.strip().encode(), token.encode()):
        return _error(403, "wrong cluster token")
    return None


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise InvalidRequestError("body", "must be a JSON object") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    return body


def _str_field(body: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(name, "must be a non-empty string")
    return value


def _room_id(body: dict[str, Any]) -> int:
    value = body.get("room_id")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_ROOM_ID:
        raise InvalidRequestError("room_id", "must be an integer in [0, 2**63)")
    return value


def internal_routes(worker: InternalWorker, token: str) -> list[Route]:
    """The `/internal/*` routes of `worker`, guarded by the cluster `token`."""

    def guarded(handler):  # type: ignore[no-untyped-def]
        async def endpoint(request: Request) -> JSONResponse:
            denied = _check_token(request, token)
            if denied is not None:
                return denied
            try:
                return await handler(request)
            except InvalidRequestError as exc:
                return _error(400, str(exc), exc.field)
            except PDEngineError as exc:
                return _error(exc.http_status, str(exc))

        return endpoint

    async def register(request: Request) -> JSONResponse:
        body = await _json_object(request)
        peer = _str_field(body, "peer")
        url = _str_field(body, "url", required=False)
        try:
            metadata = base64.b64decode(_str_field(body, "agent_metadata") or "", validate=True)
        except binascii.Error as exc:
            raise InvalidRequestError("agent_metadata", "must be base64") from exc
        await worker.register_peer(peer or "", metadata, url=url)
        own = base64.b64encode(worker.agent_metadata()).decode()
        return JSONResponse({"peer": worker.name, "agent_metadata": own})

    async def destination(request: Request) -> JSONResponse:
        body = await _json_object(request)
        room_id = _room_id(body)
        peer = _str_field(body, "peer") or ""
        pages = body.get("dst_pages")
        if not isinstance(pages, list) or not pages or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pages
        ):
            raise InvalidRequestError("dst_pages", "must be a non-empty list of page indices")
        if not worker.is_registered(peer):
            return _error(409, f"peer {peer!r} is not registered", "peer")
        await worker.add_destination(room_id, peer, pages)
        return JSONResponse({"ok": True})

    async def heartbeat(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, "peer": worker.name})

    return [
        Route("/internal/register", guarded(register), methods=["POST"]),
        Route("/internal/destination", guarded(destination), methods=["POST"]),
        Route("/internal/heartbeat", guarded(heartbeat), methods=["GET"]),
    ]
