"""Endpoints every role serves: /health, /health_generate, /metrics, /debug/rooms, /openapi.json."""

from __future__ import annotations

import os
import secrets
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdengine.server.context import ServingContext, context, public_get
from pdengine.server.generation import RequestRun
from pdengine.server.openapi import openapi_schema
from pdengine.types import SamplingParams

HEALTH_GENERATE_TIMEOUT_S = 30.0

# engine / worker stats() key -> metric gauge name, where they differ
_GAUGE_ALIASES = {
    "running": "num_running_reqs",
    "waiting": "num_queue_reqs",
    "queued": "num_queue_reqs",
    "pages_used": "kv_pages_used",
    "rooms_by_state": "rooms",
}


def gauges_from_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A stats() dict with engine names mapped onto metric names (metric names win)."""
    out = {_GAUGE_ALIASES[k]: v for k, v in stats.items() if k in _GAUGE_ALIASES}
    out.update(stats)
    return out


def current_stats(ctx: ServingContext) -> dict[str, Any]:
    source = ctx.worker if ctx.worker is not None else ctx.backend
    return dict(source.stats()) if source is not None else {}


def current_rooms(ctx: ServingContext) -> list[dict[str, Any]]:
    source = ctx.worker if ctx.worker is not None else ctx.backend
    snapshot = getattr(source, "rooms_snapshot", None)
    return list(snapshot()) if snapshot is not None else []


async def health(request: Request) -> Response:
    ctx = context(request)
    source = ctx.worker if ctx.worker is not None else ctx.backend
    return JSONResponse({"status": "ok", "role": ctx.role, "pid": os.getpid(),
                         "model": getattr(source, "model_name", None),
                         "max_model_len": getattr(source, "max_model_len", None)})


async def health_generate(request: Request) -> Response:
    """Colocated and router: one greedy token end to end. Workers: liveness only."""
    ctx = public_get(request)
    if ctx.backend is None:
        return JSONResponse({"status": "ok", "role": ctx.role, "generated": False})
    backend = ctx.backend
    bos = getattr(backend.tokenizer, "bos_token_id", None)
    prompt = [bos if bos is not None else 0]
    run = RequestRun.open(backend, ctx.metrics, ctx.limiter, f"health-{secrets.token_hex(8)}",
                          prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    try:
        with anyio.fail_after(HEALTH_GENERATE_TIMEOUT_S):
            deltas = await run.collect(request)
    except TimeoutError:
        return JSONResponse({"status": "timeout", "role": ctx.role}, status_code=503)
    finally:
        await run.close()
    tokens = sum(len(d.token_ids) for d in deltas)
    ok = tokens == 1 and run.finish_reason in ("length", "stop")
    return JSONResponse({"status": "ok" if ok else "failed", "role": ctx.role, "generated": ok},
                        status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    ctx = context(request)
    ctx.metrics.set_gauges(gauges_from_stats(current_stats(ctx)))
    body, content_type = ctx.metrics.render()
    return Response(body, media_type=content_type)


async def debug_rooms(request: Request) -> Response:
    ctx = public_get(request)
    rooms = current_rooms(ctx)
    return JSONResponse({"role": ctx.role, "count": len(rooms), "rooms": rooms})


async def openapi(request: Request) -> Response:
    ctx = context(request)
    paths = sorted({r.path for r in request.app.routes if hasattr(r, "path")})
    source = ctx.worker if ctx.worker is not None else ctx.backend
    vocab = getattr(getattr(source, "tokenizer", None), "vocab_size", None)
    return JSONResponse(openapi_schema(ctx.role, paths, vocab_size=vocab,
                                       max_model_len=getattr(source, "max_model_len", None)))
