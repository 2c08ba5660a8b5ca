"""Optional API key for the public endpoints (``--api-key``).

Clients send ``Authorization: Bearer <key>`` (what the OpenAI client does).
The comparison is constant-time. Probes and scrapes (`/health`, `/metrics`,
`/openapi.json`) stay open; `/internal/*` has its own cluster-token check.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from pdengine.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def keys_match(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def require_api_key(request: Request, api_key: str) -> None:
    """Raise 401 unless the request carries `api_key` (no-op when no key is configured)."""
    if not api_key or request.url.path in OPEN_PATHS or request.url.path.startswith("/internal/"):
        return
    token = bearer_token(request)
    if not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
    if not keys_match(token, api_key):
        raise APIError(401, "invalid API key")
