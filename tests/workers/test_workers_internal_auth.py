"""The internal (worker-to-worker) endpoints on a real uvicorn server: token checks, validation."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette

from pdengine.config import SchedulerConfig
from pdengine.server.internal import internal_routes
from pdengine.workers import DecodeWorker, PrefillWorker

TOKEN = "cluster-secret"
CONFIG = SchedulerConfig(num_pages=64)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker.create("tiny", "loopback", scheduler=CONFIG)
    decode = DecodeWorker.create("tiny", "loopback", scheduler=CONFIG,
                                 loaded=(prefill.model, prefill.tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            await tg.start(prefill.run)
            yield
            tg.cancel_scope.cancel()

    app = Starlette(routes=internal_routes(prefill, TOKEN), lifespan=lifespan)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", prefill, decode
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _registration(decode: DecodeWorker) -> dict:
    meta = base64.b64encode(decode.agent_metadata()).decode()
    return {"peer": decode.name, "agent_metadata": meta}


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/internal/heartbeat"), ("POST", "/internal/register"),
     ("POST", "/internal/destination")],
)
def test_every_internal_route_needs_the_token(served, method: str, path: str) -> None:
    url, _, decode = served
    body = _registration(decode) if path.endswith("register") else {}
    missing = httpx.request(method, url + path, json=body)
    assert missing.status_code == 401
    wrong = httpx.request(method, url + path, json=body, headers=_auth("not-the-token"))
    assert wrong.status_code == 403
    basic = httpx.request(method, url + path, json=body, headers={"Authorization": "Basic eA=="})
    assert basic.status_code == 401


def test_a_peer_refused_for_its_token_is_not_registered(served) -> None:
    url, prefill, decode = served
    r = httpx.post(url + "/internal/register", json=_registration(decode), headers=_auth("x"))
    assert r.status_code == 403
    assert not prefill.is_registered(decode.name)
    dst = {"room_id": 1, "peer": decode.name, "dst_pages": [0, 1]}
    r = httpx.post(url + "/internal/destination", json=dst, headers=_auth(TOKEN))
    assert r.status_code == 409 and "not registered" in r.json()["error"]["message"]
    assert prefill.stats()["early_destinations"] == 0


def test_registration_and_destination_with_the_token(served) -> None:
    url, prefill, decode = served
    r = httpx.post(url + "/internal/register", json=_registration(decode), headers=_auth(TOKEN))
    assert r.status_code == 200
    reply = r.json()
    assert reply["peer"] == prefill.name
    assert base64.b64decode(reply["agent_metadata"]) == prefill.agent_metadata()
    assert prefill.is_registered(decode.name)
    ok = {"room_id": 77, "peer": decode.name, "dst_pages": [3, 4, 5]}
    assert httpx.post(url + "/internal/destination", json=ok, headers=_auth(TOKEN)).json() == {
        "ok": True}
    assert prefill.stats()["early_destinations"] == 1  # held until the room's prefill arrives
    hb = httpx.get(url + "/internal/heartbeat", headers=_auth(TOKEN))
    assert hb.json() == {"ok": True, "peer": prefill.name}


@pytest.mark.parametrize(
    ("body", "field"),
    [({"room_id": -1, "dst_pages": [1]}, "room_id"),
     ({"room_id": "7", "dst_pages": [1]}, "room_id"),
     ({"room_id": 7, "dst_pages": []}, "dst_pages"),
     ({"room_id": 7, "dst_pages": [1, -2]}, "dst_pages"),
     ({"room_id": 7, "dst_pages": [1], "peer": ""}, "peer")],
)
def test_bad_destination_fields_are_named(served, body: dict, field: str) -> None:
    url, _, decode = served
    r = httpx.post(url + "/internal/destination", json={"peer": decode.name, **body},
                   headers=_auth(TOKEN))
    assert r.status_code == 400
    assert r.json()["error"]["field"] == field


def test_bad_registration_is_a_400(served) -> None:
    url, _, decode = served
    body = {"peer": decode.name, "agent_metadata": "%%% not base64"}
    r = httpx.post(url + "/internal/register", json=body, headers=_auth(TOKEN))
    assert r.status_code == 400 and r.json()["error"]["field"] == "agent_metadata"
    r = httpx.post(url + "/internal/register", content=b"[1,2", headers=_auth(TOKEN))
    assert r.status_code == 400
    junk = {"peer": "x", "agent_metadata": base64.b64encode(b"not an agent").decode()}
    r = httpx.post(url + "/internal/register", json=junk, headers=_auth(TOKEN))
    assert r.status_code == 400 and r.json()["error"]["field"] == "agent_metadata"
