"""The router's Starlette app: the public API over `RouterBackend`, plus
``/debug/workers`` and a ``/debug/rooms`` that gathers every worker's rooms."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from pdengine.config import SchedulerConfig
from pdengine.server.app import common_routes, generation_routes, make_app, stop_on_failure
from pdengine.server.context import AppSettings, ServingContext, public_get
from pdengine.server.router import RouterBackend
from pdengine.telemetry.metrics import Metrics


def _router(request: Request) -> RouterBackend:
    backend = public_get(request).require_backend()
    assert isinstance(backend, RouterBackend)
    return backend


async def debug_workers(request: Request) -> Response:
    router = _router(request)
    return JSONResponse({"policy": router.policy,
                         "workers": [w.describe() for w in router.workers()]})


async def debug_rooms(request: Request) -> Response:
    """Every worker's live rooms, each tagged with the worker's URL."""
    router = _router(request)
    rooms: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []

    async def fetch(client: httpx.AsyncClient, url: str) -> None:
        try:
            r = await client.get(url + "/debug/rooms")
            r.raise_for_status()
            rooms.extend({**room, "worker": url} for room in r.json().get("rooms", []))
        except (httpx.HTTPError, ValueError) as exc:
            errors.append({"worker": url, "error": str(exc)})

    auth = request.headers.get("authorization")
    async with httpx.AsyncClient(timeout=5.0, headers={"authorization": auth} if auth else {}
                                 ) as client, anyio.create_task_group() as tg:
        for w in router.workers():
            tg.start_soon(fetch, client, w.url)
    return JSONResponse({"role": "router", "count": len(rooms), "rooms": rooms, "errors": errors})


def model_limits(model: str) -> tuple[Any, int]:
    """(tokenizer, max_model_len) of `model` without loading its weights."""
    from pdengine.model import Tokenizer, resolve_model

    path = resolve_model(model)
    config = json.loads((Path(path) / "config.json").read_text())
    limit = min(SchedulerConfig().max_model_len, int(config.get("max_position_embeddings", 1 << 30)))
    return Tokenizer.load(path), limit


def create_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    model: str = "tiny",
    *,
    policy: str = "round_robin",
    settings: AppSettings | None = None,
) -> Starlette:
    settings = settings or AppSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tokenizer, limit = await anyio.to_thread.run_sync(model_limits, model)
        backend = RouterBackend(prefill_urls, decode_urls, model_name=model, tokenizer=tokenizer,
                                max_model_len=limit, policy=policy, api_key=settings.api_key)
        async with stop_on_failure(app, "router"), anyio.create_task_group() as tg:
            await tg.start(backend.run)
            app.state.ctx = ServingContext("router", settings, Metrics("router"), backend=backend)
            try:
                yield
            finally:
                app.state.ctx = None
                tg.cancel_scope.cancel()

    routes: list[BaseRoute] = [
        Route("/debug/workers", debug_workers, methods=["GET"]),
        Route("/debug/rooms", debug_rooms, methods=["GET"]),
        *generation_routes(),
        *common_routes(),
    ]
    return make_app(routes, lifespan)
