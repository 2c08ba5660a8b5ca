"""`pdengine serve`: run a router, a prefill and a decode worker as child processes.

Lifecycle:
1. Bind the three listening sockets here (the router on ``--port``, the workers on
   free ports of 127.0.0.1) and pass each to its child as an inherited fd, so no
   port can be taken between choosing and using it.
2. Start the children with the cluster token (given or generated) and API key in
   their environment, and this process's pid: each child dies with its parent
   (``PR_SET_PDEATHSIG`` on Linux, and a parent-pid watch everywhere).
3. Wait until every ``/health`` answers, then print ``pdengine ready: URL``.
4. Supervise: if a child exits, stop the others and exit non-zero. On Ctrl-C or
   SIGTERM stop the router first, then the workers (SIGTERM, then SIGKILL after
   a grace period).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdengine.server.launch import (
    API_KEY_ENV,
    CLUSTER_TOKEN_ENV,
    PARENT_PID_ENV,
    bind_socket,
    url_of,
)

STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    role: str
    url: str
    proc: subprocess.Popen[bytes]


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return preexec


def _spawn(role: str, argv: list[str], fd: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdengine.cli", role, "--fd", str(fd), *argv]
    return subprocess.Popen(cmd, env=env, pass_fds=(fd,), preexec_fn=die_with_parent(),
                            stdout=sys.stderr)


def _wait_healthy(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = {c.url: c for c in children}
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for url, child in list(pending.items()):
                if child.proc.poll() is not None:
                    raise RuntimeError(f"the {child.role} process exited with code "
                                       f"{child.proc.returncode} during start-up")
                try:
                    if client.get(url + "/health").status_code == 200:
                        del pending[url]
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {sorted(pending)}")
            if pending:
                time.sleep(0.2)


def stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the router first, then the workers together (each may wait on the other's
    connections); SIGKILL what outlives the grace period."""
    routers = [c for c in children if c.role == "router"]
    for group in (routers, [c for c in children if c.role != "router"]):
        live = [c for c in group if c.proc.poll() is None]
        for child in live:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in live:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def serve_pd(args: argparse.Namespace) -> int:
    token = args.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV) or secrets.token_urlsafe(32)
    env = {**os.environ, CLUSTER_TOKEN_ENV: token, PARENT_PID_ENV: str(os.getpid())}
    if args.api_key:
        env[API_KEY_ENV] = args.api_key
    common = ["--model", args.model, "--log-level", args.log_level,
              "--max-body-bytes", str(args.max_body_bytes),
              "--max-concurrent-requests", str(args.max_concurrent_requests)]
    router_sock = bind_socket(args.host, args.port)
    worker_socks = {role: bind_socket("127.0.0.1", 0) for role in ("prefill", "decode")}
    urls = {role: url_of(s) for role, s in worker_socks.items()}

    stop_requested = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        for role, sock in worker_socks.items():
            argv = [*common, "--transport", args.transport, "--advertise-url", urls[role]]
            children.append(Child(role, urls[role], _spawn(role, argv, sock.fileno(), env)))
        router_argv = [*common, "--policy", args.policy, "--prefill", urls["prefill"],
                       "--decode", urls["decode"]]
        router = Child("router", url_of(router_sock),
                       _spawn("router", router_argv, router_sock.fileno(), env))
        children.insert(0, router)
        for sock in (router_sock, *worker_socks.values()):
            sock.close()  # the children hold their own copies
        try:
            _wait_healthy(children, args.startup_timeout)
        except RuntimeError as exc:
            print(f"pdengine: {exc}", file=sys.stderr)
            return 1
        print(f"pdengine ready: {router.url}", flush=True)
        while not stop_requested:
            for child in children:
                if child.proc.poll() is not None:
                    print(f"pdengine: the {child.role} process exited with code "
                          f"{child.proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        stop_children(children)
        for s, handler in previous.items():
            signal.signal(s, handler)
