"""Fixtures for the serving tests: real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from pdengine.server.app import create_colocated_app
from pdengine.server.context import AppSettings
from pdengine.server.launch import bind_socket, url_of

MAX_BODY = 64 * 1024


class ThreadServer:
    """A real uvicorn server (socket on 127.0.0.1, lifespan on) in a thread of the test process."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = url_of(self.sock)
        config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="uvicorn-test", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a real /metrics exposition, parsed with prometheus_client's parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gauge(samples: dict, name: str, role: str) -> float:
    return samples[(name, (("role", role),))]


@pytest.fixture(scope="module")
def colocated() -> Iterator[ThreadServer]:
    app = create_colocated_app("tiny", settings=AppSettings(max_body_bytes=MAX_BODY))
    with ThreadServer(app) as server:
        yield server
