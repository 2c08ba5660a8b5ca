"""A PD deployment made of separate real processes (`pdengine prefill|decode|router`) on
127.0.0.1, for fault tests that kill, stall and restart one role at a time.

Each role listens on a fixed free port, so a restarted role comes back at the same URL the
router and its peer already know. Every process is started in its own session and is
killed by the fixture's finalizer (`Cluster.close`), whatever the test did.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdengine.server.diagnostics_scrape import WorkerRef, idle_report, scrape_all

START_TIMEOUT_S = 180.0  # a loaded 2-core CI box needs ~10-20 s per process
# Small deadlines so a fault ends in seconds, not minutes.
FAST_DEADLINES = ("bootstrap_s=5,waiting_for_input_s=5,transfer_progress_s=3,transfer_total_s=8,"
                  "drain_s=2,write_s=3")
# The latest a failed receiver's quarantined pages are released when the abort-ack never comes
# (fsm `_drain_deadline`: bootstrap + bound + drain after the room's creation), plus slack.
QUARANTINE_BOUND_S = 5 + (5 + 5 + 8) + 2 + 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Role:
    """One `pdengine <role>` process at a fixed address (restartable)."""

    role: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    wrap: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "ns"]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.role}-{self.port}-{self.starts}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.role} is running"
        self.starts += 1
        cmd = [*self.wrap, sys.executable, "-m", "pdengine.cli", self.role,
               "--host", self.host, "--port", str(self.port), *self.argv]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the role answers /health (or, inside another network namespace, where this
        process cannot connect, until it prints its ready line)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{self.tail()}")
                if self.wrap:
                    if f"pdengine {self.role} ready:" in self.tail(100_000):
                        return
                else:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"{self.url}/health").status_code == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.role} not ready in {timeout_s}s:\n{self.tail()}")
                time.sleep(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the role's whole process group (it was started in its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Cluster:
    """prefill + decode + router as three processes; faults and deadlines via the environment.

    `worker_env` applies to both workers, `prefill_env` / `decode_env` to one of them (the
    fault transport wraps the sending side for WRITE faults and the receiving side for
    notification faults and corruption).
    """

    def __init__(self, log_dir: Path, *, worker_env: dict[str, str] | None = None,
                 prefill_env: dict[str, str] | None = None,
                 decode_env: dict[str, str] | None = None,
                 router_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                 hosts: tuple[str, str, str] = ("127.0.0.1",) * 3,
                 wraps: tuple[list[str], list[str], list[str]] = ([], [], [])) -> None:
        self.token = secrets.token_urlsafe(24)
        base = {**os.environ, "PDENGINE_CLUSTER_TOKEN": self.token,
                "PDENGINE_DEADLINES": FAST_DEADLINES}
        base.pop("PDENGINE_FAULTS", None)
        base.pop("PDENGINE_API_KEY", None)
        wenv = {**base, **(worker_env or {})}
        p_host, d_host, r_host = hosts
        common = ["--model", "tiny", "--log-level", "warning"]
        # Ports free here; inside a fresh network namespace (`wraps`) every port is free.
        self.prefill = Role("prefill", [*common, *worker_args], {**wenv, **(prefill_env or {})},
                            log_dir, p_host, free_port(), wraps[0])
        self.decode = Role("decode", [*common, *worker_args], {**wenv, **(decode_env or {})},
                           log_dir, d_host, free_port(), wraps[1])
        self.router = Role("router", common, base, log_dir, r_host, free_port(), wraps[2])
        self._router_args = router_args

    def start(self) -> Cluster:
        for role in (self.prefill, self.decode):
            role.argv += ["--advertise-url", role.url]
        self.router.argv += ["--prefill", self.prefill.url, "--decode", self.decode.url,
                             *self._router_args]
        for role in self.roles:
            role.start()
        for role in self.roles:
            role.wait_ready()
        if not self.router.wrap:
            self.wait_router_sees_workers()
        return self

    @property
    def roles(self) -> tuple[Role, Role, Role]:
        return (self.prefill, self.decode, self.router)

    @property
    def url(self) -> str:
        return self.router.url

    def close(self) -> None:
        for role in self.roles:
            role.stop()

    def extra_router(self, *args: str, env: dict[str, str] | None = None) -> Role:
        """Another router in front of the same workers (e.g. with `--api-key`); the caller
        stops it (it is not one of `roles`)."""
        router = Role("router", ["--model", "tiny", "--log-level", "warning",
                                 "--prefill", self.prefill.url, "--decode", self.decode.url,
                                 *args], {**self.router.env, **(env or {})},
                      self.router.log_dir, self.router.host, free_port())
        router.start()
        try:
            router.wait_ready()
        except BaseException:
            router.stop()
            raise
        return router

    def restart(self, role: Role) -> None:
        role.kill()
        role.start()
        role.wait_ready()
        self.wait_router_sees_workers()

    def wait_router_sees_workers(self, timeout_s: float = 30.0) -> None:
        """Until the router's health poll marks both workers healthy again."""

        def healthy() -> bool:
            with httpx.Client(timeout=2.0, trust_env=False) as c:
                body = c.get(f"{self.url}/debug/workers").json()
            return all(w["healthy"] for w in body["workers"])

        wait_for(healthy, timeout_s, "the router to see both workers healthy")

    # ---- observation -------------------------------------------------------------------

    def workers(self) -> list[WorkerRef]:
        return [WorkerRef("prefill", self.prefill.url), WorkerRef("decode", self.decode.url)]

    def busy(self) -> dict[str, float]:
        """What is not idle on the workers (empty at quiescence: I4)."""
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            return idle_report(scrape_all(client, self.workers()), 0.0)

    def busy_of(self, role: Role) -> dict[str, float]:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            return idle_report(scrape_all(client, [WorkerRef(role.role, role.url)]), 0.0)

    def wait_idle(self, timeout_s: float, role: Role | None = None) -> float:
        """Seconds until every worker gauge (of `role`, or of both workers) reads idle and no
        page is used; fails with the gauges that stayed busy."""
        start = time.monotonic()
        last: dict[str, float] = {}

        def idle() -> bool:
            nonlocal last
            last = self.busy() if role is None else self.busy_of(role)
            return not last

        try:
            wait_for(idle, timeout_s, "idle gauges")
        except AssertionError:
            raise AssertionError(f"not idle after {timeout_s}s: {last}\n{self.logs()}") from None
        return time.monotonic() - start

    def live_rooms(self) -> list[dict[str, Any]]:
        rooms: list[dict[str, Any]] = []
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for w in self.workers():
                body = client.get(f"{w.url}/debug/rooms").json()
                rooms += [r for r in body["rooms"]
                          if r.get("state") not in ("SUCCESS", "FAILED")]
        return rooms

    def counter(self, role: Role, name: str) -> float:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            return scrape_all(client, [WorkerRef(role.role, role.url)])[0].total(name)

    def logs(self) -> str:
        return "\n".join(f"--- {r.role} ---\n{r.tail(1500)}" for r in self.roles)


@contextlib.contextmanager
def cluster(log_dir: Path, **kwargs: Any) -> Iterator[Cluster]:
    c = Cluster(log_dir, **kwargs)
    try:
        yield c.start()
    finally:
        c.close()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            value = predicate()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


# ---- clients -------------------------------------------------------------------------------


@dataclass
class StreamResult:
    status: int
    tokens: int = 0
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    text: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason == "length"


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [32 + (i * 7 + salt) % 90 for i in range(n)]


def stream_completion(url: str, prompt: list[int], max_tokens: int = 8,
                      timeout_s: float = 60.0, headers: dict[str, str] | None = None
                      ) -> StreamResult:
    """One streaming /v1/completions to the end; an error event or HTTP error is recorded."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = time.monotonic()
    timeout = httpx.Timeout(10.0, read=timeout_s)
    with httpx.Client(timeout=timeout, trust_env=False) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            return StreamResult(resp.status_code, error=_json(resp.text),
                                seconds=time.monotonic() - start)
        out = StreamResult(200)
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                out.error = obj["error"]
                continue
            for choice in obj.get("choices", []):
                if choice.get("text"):
                    out.tokens += 1
                    out.text += choice["text"]
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    out.seconds = time.monotonic() - start
    return out


def _json(text: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except ValueError:
        return {"message": text}
    return body.get("error", body) if isinstance(body, dict) else {"message": text}
