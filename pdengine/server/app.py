"""Starlette app factories, one per role. The `lifespan` owns the engine or worker.

- `create_colocated_app(model)`: `Engine(mode="colocated")` behind the OpenAI and
  SGLang endpoints.
- `create_worker_app("prefill" | "decode", model)`: a `PrefillWorker` / `DecodeWorker`
  running in the lifespan's task group, its public worker endpoints and the
  `/internal/*` routes guarded by the cluster token.
- The router app lives in `pdengine.server.router`.

On startup the lifespan builds the `ServingContext` (`app.state.ctx`); on
shutdown it leaves the engine's context / cancels the worker's task group, so
no request outlives the app.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from pdengine.server import common_api, generate_api, openai_api, worker_api
from pdengine.server.context import AppSettings, ServingContext
from pdengine.server.engine_backend import EngineBackend
from pdengine.server.errors import EXCEPTION_HANDLERS
from pdengine.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def stop_on_failure(app: Starlette, role: str) -> AsyncIterator[None]:
    """Wraps a lifespan's running phase: if the engine/worker dies, the server must not live
    on as an empty shell. Record why (`/health` answers 503 with it) and stop the server
    through ``app.state.stop_server`` (set by `launch.run_app`), so a supervisor notices."""
    try:
        yield
    except BaseException as exc:
        app.state.failure = f"the {role} failed: {exc!r}"
        log.critical("%s; stopping the server", app.state.failure)
        stop = getattr(app.state, "stop_server", None)
        if stop is not None:
            stop()
        raise


def common_routes() -> list[BaseRoute]:
    return [
        Route("/health", common_api.health, methods=["GET"]),
        Route("/health_generate", common_api.health_generate, methods=["GET"]),
        Route("/metrics", common_api.metrics, methods=["GET"]),
        Route("/debug/rooms", common_api.debug_rooms, methods=["GET"]),
        Route("/openapi.json", common_api.openapi, methods=["GET"]),
    ]


def generation_routes() -> list[BaseRoute]:
    """The OpenAI and SGLang endpoints over `ctx.backend` (colocated and router)."""
    return [
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/models", openai_api.models, methods=["GET"]),
        Route("/generate", generate_api.generate, methods=["POST"]),
        Route("/abort_request", generate_api.abort_request, methods=["POST"]),
    ]


def make_app(routes: list[BaseRoute], lifespan: Callable[[Starlette], Any]) -> Starlette:
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)


def create_colocated_app(
    model: str = "tiny",
    *,
    settings: AppSettings | None = None,
    engine_options: dict[str, Any] | None = None,
) -> Starlette:
    """The colocated engine as an HTTP server (`pdengine serve --colocated`)."""
    settings = settings or AppSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        from pdengine.engine import Engine

        async with stop_on_failure(app, "colocated engine"), Engine(
            model, mode="colocated", **(engine_options or {})
        ) as engine:
            app.state.ctx = ServingContext(
                "colocated", settings, Metrics("colocated"), backend=EngineBackend(engine)
            )
            try:
                yield
            finally:
                app.state.ctx = None

    return make_app(generation_routes() + common_routes(), lifespan)


def create_worker_app(
    role: str,
    model: str = "tiny",
    *,
    cluster_token: str,
    transport: str = "nixl",
    settings: AppSettings | None = None,
    worker_options: dict[str, Any] | None = None,
) -> Starlette:
    """A prefill or decode worker process's app; the worker runs inside the lifespan."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, not {role!r}")
    if not cluster_token:
        raise ValueError("a worker needs a cluster token (--cluster-token or PDENGINE_CLUSTER_TOKEN)")
    settings = settings or AppSettings()
    from pdengine.server.internal import internal_routes

    app_routes: list[BaseRoute] = [
        Route("/generate",
              worker_api.prefill_generate if role == "prefill" else worker_api.decode_generate,
              methods=["POST"]),
        Route("/abort_request", worker_api.worker_abort, methods=["POST"]),
        *common_routes(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        from pdengine.workers import DecodeWorker, PrefillWorker

        cls = PrefillWorker if role == "prefill" else DecodeWorker
        metrics = Metrics(role)
        worker = await anyio.to_thread.run_sync(
            lambda: cls.create(model, transport=transport, metrics=metrics,
                               **{"cluster_token": cluster_token, **(worker_options or {})})
        )
        for route in internal_routes(worker, cluster_token):
            app.router.routes.append(route)
        async with stop_on_failure(app, f"{role} worker"), anyio.create_task_group() as tg:
            await tg.start(worker.run)
            app.state.ctx = ServingContext(role, settings, metrics, worker=worker)
            try:
                yield
            finally:
                app.state.ctx = None
                tg.cancel_scope.cancel()

    return make_app(app_routes, lifespan)
