"""What every endpoint of one app shares, kept on ``app.state.ctx`` by the lifespan."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pdengine.server.auth import require_api_key
from pdengine.server.body import read_json
from pdengine.server.errors import APIError
from pdengine.server.generation import Backend, ConcurrencyLimiter
from pdengine.telemetry.metrics import Metrics


@dataclass(frozen=True)
class AppSettings:
    api_key: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 256


@dataclass
class ServingContext:
    role: str  # colocated | prefill | decode | router
    settings: AppSettings
    metrics: Metrics
    backend: Backend | None = None  # colocated engine or router: the OpenAI/SGLang endpoints
    worker: Any = None  # PrefillWorker | DecodeWorker
    extras: dict[str, Any] = field(default_factory=dict)  # per-role state (e.g. rid -> room)
    limiter: ConcurrencyLimiter = field(init=False)
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.limiter = ConcurrencyLimiter(self.settings.max_concurrent_requests)

    def require_backend(self) -> Backend:
        if self.backend is None:
            raise APIError(404, f"not served by a {self.role} worker; send it to the router")
        return self.backend


def context(request: Request) -> ServingContext:
    ctx = getattr(request.app.state, "ctx", None)
    if ctx is None:
        failure = getattr(request.app.state, "failure", None)
        raise APIError(503, failure or "server is starting or stopping")
    return ctx


async def public_json(request: Request) -> tuple[ServingContext, dict[str, Any]]:
    """Auth check, then the JSON body (size-limited) of a public POST endpoint."""
    ctx = context(request)
    require_api_key(request, ctx.settings.api_key)
    return ctx, await read_json(request, ctx.settings.max_body_bytes)


def public_get(request: Request) -> ServingContext:
    ctx = context(request)
    require_api_key(request, ctx.settings.api_key)
    return ctx
