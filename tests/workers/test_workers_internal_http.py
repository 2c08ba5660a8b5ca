"""Worker-to-worker HTTP on a real uvicorn server: token checks, validation, heartbeats (I6)."""

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

from pdengine.config import Deadlines, SchedulerConfig
from pdengine.fsm import RoomState
from pdengine.server.internal import internal_routes
from pdengine.types import RequestFailedError, SamplingParams
from pdengine.workers import DecodeWorker, LivenessConfig, PrefillWorker

TOKEN = "cluster-secret"
CONFIG = SchedulerConfig(num_pages=64)


class PrefillServer:
    """A PrefillWorker behind its internal routes on a real uvicorn server (own thread + loop)."""

    def __init__(self, prefill: PrefillWorker) -> None:
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with anyio.create_task_group() as tg:
                await tg.start(prefill.run)
                yield
                tg.cancel_scope.cancel()

        app = Starlette(routes=internal_routes(prefill, TOKEN), lifespan=lifespan)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    def __enter__(self) -> PrefillServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker.create("tiny", "loopback", scheduler=CONFIG)
    decode = DecodeWorker.create("tiny", "loopback", scheduler=CONFIG,
                                 loaded=(prefill.model, prefill.tokenizer))
    with PrefillServer(prefill) as server:
        yield server.url, prefill, decode


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


async def test_a_silent_prefill_fails_the_decode_room_by_heartbeat_not_by_deadline() -> None:
    deadlines = Deadlines(bootstrap_s=30, waiting_for_input_s=30, transfer_progress_s=30,
                          drain_s=0.3)
    liveness = LivenessConfig(interval_s=0.1, timeout_s=0.3, max_misses=2)
    prefill = PrefillWorker.create("tiny", "loopback", scheduler=CONFIG)
    decode = DecodeWorker.create("tiny", "loopback", scheduler=CONFIG, deadlines=deadlines,
                                 liveness=liveness, cluster_token=TOKEN,
                                 loaded=(prefill.model, prefill.tokenizer))
    server = PrefillServer(prefill).__enter__()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(decode.run)
            stream = decode.stream(9, list(range(3, 60)), SamplingParams(max_tokens=4),
                                   server.url)
            with anyio.fail_after(10):
                while decode.room_state(9) is not RoomState.WAITING_FOR_INPUT:
                    await anyio.sleep(0.01)
            assert prefill.stats()["early_destinations"] == 1  # registered, pages sent
            await anyio.to_thread.run_sync(server.__exit__, None, None, None)  # prefill dies
            started = time.monotonic()
            with anyio.fail_after(10), pytest.raises(RequestFailedError, match="heartbeat"):
                async for _ in stream:
                    pass
            assert time.monotonic() - started < deadlines.waiting_for_input_s / 3
            with anyio.fail_after(5):
                while decode.stats()["kv_pages_used"]:
                    await anyio.sleep(0.01)  # quarantined until the drain deadline
            assert decode.actor.result(9).state is RoomState.FAILED
            assert decode.stats()["rooms_live"] == 0 and decode.stats()["peers"] == 0
            tg.cancel_scope.cancel()
    finally:
        server.__exit__(None, None, None)


async def test_an_unreachable_prefill_fails_the_request_and_returns_the_pages() -> None:
    decode = DecodeWorker.create("tiny", "loopback", scheduler=CONFIG, cluster_token=TOKEN)
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    async with anyio.create_task_group() as tg:
        await tg.start(decode.run)
        with anyio.fail_after(10), pytest.raises(RequestFailedError, match="cannot register"):
            async for _ in decode.stream(3, list(range(3, 40)), SamplingParams(), url):
                pass
        stats = decode.stats()
        assert stats["kv_pages_used"] == 0 and stats["rooms_live"] == 0
        assert stats["requests_in_flight"] == 0 and stats["failed"] == 1
        tg.cancel_scope.cancel()
