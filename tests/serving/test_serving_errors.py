"""Bad requests get exact status codes and messages naming the field; nothing leaks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import pytest
from conftest import MAX_BODY, ThreadServer, gauge, scrape
from starlette.applications import Starlette

from pdengine.server.app import common_routes, make_app, stop_on_failure

LONG_PROMPT = list(range(1, 200)) * 25  # 4975 tokens > the tiny model's 4096

CASES = [
    # (path, body, status, field named in the message)
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),  # would kill torch
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "model": "nope"}, 404, "model"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
    ("/generate", {}, 400, "text"),
    ("/generate", {"input_ids": "1 2 3"}, 400, "input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400,
     "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"frobnicate": 1}}, 400, "frobnicate"),
    ("/generate", {"text": "a", "sampling_params": []}, 400, "sampling_params"),
    ("/generate", {"text": "a", "rid": 7}, 400, "rid"),
    ("/generate", {"input_ids": LONG_PROMPT}, 400, "prompt"),
    ("/abort_request", {}, 400, "rid"),
]


@pytest.fixture(scope="module")
def client(colocated: ThreadServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=colocated.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize(("path", "body", "status", "field"), CASES)
def test_bad_field_is_named(client: httpx.Client, path: str, body: dict, status: int,
                            field: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"].startswith(field + ":"), error
    assert error["param"] == field
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"\xff\xfe", b"null"])
def test_malformed_body_is_400(client: httpx.Client, raw: bytes) -> None:
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_the_limit_is_413_declared_or_streamed(client: httpx.Client) -> None:
    big = b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}'
    declared = client.post("/v1/completions", content=big)  # with Content-Length
    assert declared.status_code == 413
    assert declared.json()["error"]["type"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    streamed = client.post("/generate", content=chunks())
    assert streamed.status_code == 413


def test_wrong_method_and_unknown_path(client: httpx.Client) -> None:
    assert client.get("/v1/completions").status_code == 405
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_refused_requests_leave_nothing_behind(client: httpx.Client,
                                               colocated: ThreadServer) -> None:
    for path, body, _, _ in CASES:
        client.post(path, json=body)
    samples = scrape(colocated.url)
    for name in ("pdengine_num_running_reqs", "pdengine_num_queue_reqs", "pdengine_kv_pages_used"):
        assert gauge(samples, name, "colocated") == 0, name
    assert client.get("/debug/rooms").json()["count"] == 0


def test_duplicate_rid_is_refused_without_losing_a_slot(colocated: ThreadServer) -> None:
    body = {"text": "dup", "rid": "same-rid", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", colocated.url + "/generate", json=body, timeout=60) as first:
        lines = first.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        for _ in range(3):
            again = httpx.post(colocated.url + "/generate", json={**body, "stream": False})
            assert again.status_code == 400
            assert again.json()["error"]["param"] == "request_id"
    context = colocated.app.state.ctx
    deadline = time.monotonic() + 2
    while context.limiter.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert context.limiter.in_flight == 0  # every refused request gave its slot back


def test_a_dying_engine_stops_the_server_instead_of_leaving_a_shell() -> None:
    """The lifespan's guard: a crash of what the app owns stops uvicorn, with the reason."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def crash_soon() -> None:
            await anyio.sleep(0.2)
            raise RuntimeError("the engine loop died")

        async with stop_on_failure(app, "test engine"), anyio.create_task_group() as tg:
            tg.start_soon(crash_soon)
            yield

    app = make_app(common_routes(), lifespan)
    server = ThreadServer(app)
    app.state.stop_server = lambda: setattr(server.server, "should_exit", True)
    with server:
        server.thread.join(10)
        assert not server.thread.is_alive()  # uvicorn stopped by itself
    assert "the test engine failed" in app.state.failure
    assert "the engine loop died" in app.state.failure
