"""HTTP client for a peer worker's `/internal/*` endpoints (pdengine/server/internal.py).

One `PeerClient` per worker process; it keeps one `httpx.AsyncClient` (connection
pool) and sends the cluster token with every request. Any transport error, timeout
or non-2xx answer becomes a `PeerError` naming the peer and the cause.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx


class PeerError(Exception):
    """A call to a peer's internal endpoint failed (unreachable, timeout, refused)."""


class PeerClient:
    def __init__(self, token: str, timeout_s: float = 5.0) -> None:
        self._headers = {"Authorization": f"Bearer {token}"}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=self._headers)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, url: str, json: dict[str, Any] | None = None) -> Any:
        try:
            resp = await self._client.request(method, url, json=json)
        except httpx.HTTPError as exc:
            raise PeerError(f"{url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise PeerError(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()

    async def register(
        self, base_url: str, name: str, agent_metadata: bytes, url: str | None = None
    ) -> tuple[str, bytes]:
        """Register this worker with the peer; returns the peer's (name, agent metadata)."""
        body = {"peer": name, "agent_metadata": base64.b64encode(agent_metadata).decode()}
        if url:
            body["url"] = url
        reply = await self._call("POST", f"{base_url}/internal/register", body)
        return str(reply["peer"]), base64.b64decode(reply["agent_metadata"])

    async def add_destination(
        self, base_url: str, room_id: int, name: str, dst_pages: list[int]
    ) -> None:
        body = {"room_id": room_id, "peer": name, "dst_pages": list(dst_pages)}
        await self._call("POST", f"{base_url}/internal/destination", body)

    async def heartbeat(self, base_url: str, timeout_s: float) -> str:
        """The peer's name if it answers within `timeout_s`; PeerError otherwise."""
        try:
            resp = await self._client.get(f"{base_url}/internal/heartbeat", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise PeerError(f"{base_url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise PeerError(f"{base_url}: heartbeat HTTP {resp.status_code}")
        return str(resp.json().get("peer", ""))
