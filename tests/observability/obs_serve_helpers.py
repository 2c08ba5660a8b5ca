"""Start a real `pdengine serve` (router + prefill + decode processes) for a test module."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Served:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            if client.get(f"{url}/health").status_code != 200:
                return False
            body = client.get(f"{url}/debug/workers").json()
    except (httpx.HTTPError, ValueError):
        return False
    workers = body.get("workers", []) if isinstance(body, dict) else body
    roles = {w.get("role") for w in workers if w.get("healthy", True)}
    return {"prefill", "decode"} <= roles


@contextmanager
def running_serve(
    workdir: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120.0
) -> Iterator[Served]:
    """`pdengine serve --model tiny` on a free port until the block ends (then SIGTERM)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"serve-{port}.log"
    full_env = {**os.environ, **(env or {})}
    cmd = [sys.executable, "-m", "pdengine.cli", "serve", "--model", "tiny",
           "--host", "127.0.0.1", "--port", str(port), *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    served = Served(url, proc, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"pdengine serve exited {proc.returncode}:\n{served.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pdengine serve not ready in {timeout_s}s:\n{served.log_tail()}")
            time.sleep(0.2)
        yield served
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait(10)


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


class BackgroundLoad:
    """`clients` threads sending streaming completions in a loop until stopped."""

    def __init__(self, url: str, clients: int = 3, prompt_tokens: int = 300,
                 max_tokens: int = 48) -> None:
        self.url, self.clients = url, clients
        self.payload = {"prompt": [65 + i % 26 for i in range(prompt_tokens)],
                        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                        "stream": True}
        self.completed = 0
        self.streamed = 0  # SSE events received
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        with httpx.Client(timeout=60.0, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", f"{self.url}/v1/completions",
                                       json=self.payload) as resp:
                        if resp.status_code != 200:
                            self.errors.append(f"http {resp.status_code}")
                            continue
                        for line in resp.iter_lines():
                            if self._stop.is_set():
                                return  # leaves mid-stream: the server aborts the request
                            if line.startswith("data:"):
                                self.streamed += 1
                    self.completed += 1
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def __enter__(self) -> BackgroundLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
