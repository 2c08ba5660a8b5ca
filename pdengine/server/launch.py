"""`pdengine serve | prefill | decode | router`: argument parsing and running one app on uvicorn.

- ``pdengine serve``: router + one prefill + one decode worker as child processes
  (see `pdengine.server.supervisor`); ``--colocated`` runs the colocated engine's
  app in this process instead.
- ``pdengine prefill|decode``: one worker; ``pdengine router --prefill URL --decode URL``:
  the router (repeat the flags for more workers). For multi-machine deployments
  bind with ``--host`` and tell peers where to reach you with ``--advertise-url``.

Secrets come from flags or the environment (``PDENGINE_CLUSTER_TOKEN``,
``PDENGINE_API_KEY``); the supervisor hands them to its children via the
environment, never on the command line. Every role prints one line
``pdengine <role> ready: URL`` (``pdengine ready: URL`` for serve) when it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from pdengine.server.context import AppSettings
from pdengine.server.diagnostics_env import worker_options_from_env
from pdengine.telemetry.tracing import TRACE_FILE_ENV, setup_tracing

CLUSTER_TOKEN_ENV = "PDENGINE_CLUSTER_TOKEN"
API_KEY_ENV = "PDENGINE_API_KEY"
PARENT_PID_ENV = "PDENGINE_PARENT_PID"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port); bound here so a port is never raced."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"pdengine: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


async def _watch_parent(server: uvicorn.Server, parent_pid: int) -> None:
    """Stop when the supervising parent is gone (PDEATHSIG covers Linux; this covers the rest)."""
    while not server.should_exit:
        if os.getppid() != parent_pid:
            server.should_exit = True
            return
        await asyncio.sleep(0.5)


async def _announce(server: uvicorn.Server, line: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    print(line, flush=True)


class _Server(uvicorn.Server):
    """uvicorn, except that a stop by SIGINT/SIGTERM ends with exit code 0 once shut down
    (uvicorn re-raises the signal after its graceful shutdown, which reads as a crash)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_app(app: Starlette, sock: socket.socket, role: str, log_level: str = "warning") -> int:
    """Serve `app` on `sock` until SIGINT/SIGTERM (or the parent's death); returns an exit code."""
    config = uvicorn.Config(app, lifespan="on", log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    server = _Server(config)
    app.state.stop_server = lambda: setattr(server, "should_exit", True)  # see stop_on_failure
    parent = os.environ.get(PARENT_PID_ENV)
    banner = "pdengine ready" if role == "serve" else f"pdengine {role} ready"

    async def main() -> None:
        tasks = [asyncio.create_task(_announce(server, f"{banner}: {url_of(sock)}"))]
        if parent and parent.isdigit():
            tasks.append(asyncio.create_task(_watch_parent(server, int(parent))))
        try:
            await server.serve(sockets=[sock])
        finally:
            for t in tasks:
                t.cancel()

    asyncio.run(main())
    failed = getattr(app.state, "failure", None) is not None
    return 0 if server.started and not failed else 1


# ---- argument parsing -------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (built in) or a checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=default_port, help="port (0: any free port)")
    p.add_argument("--api-key", default=None, help=f"require this bearer key (env {API_KEY_ENV})")
    p.add_argument("--max-body-bytes", type=int, default=AppSettings.max_body_bytes)
    p.add_argument("--max-concurrent-requests", type=int,
                   default=AppSettings.max_concurrent_requests)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)  # from the supervisor
    p.add_argument("--trace-file", default=None, metavar="PATH",
                   help=f"append finished trace spans as JSON lines (env {TRACE_FILE_ENV})")


def _add_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=("nixl", "loopback"), default="nixl")
    p.add_argument("--cluster-token", default=None,
                   help=f"shared secret of the internal endpoints (env {CLUSTER_TOKEN_ENV})")
    p.add_argument("--advertise-url", default=None,
                   help="URL peers use to reach this worker (default: the bound address)")


def settings_of(args: argparse.Namespace) -> AppSettings:
    return AppSettings(api_key=args.api_key or os.environ.get(API_KEY_ENV, ""),
                       max_body_bytes=args.max_body_bytes,
                       max_concurrent_requests=args.max_concurrent_requests)


def _socket_of(args: argparse.Namespace) -> socket.socket:
    if args.fd is not None:
        return socket.socket(fileno=args.fd)
    return bind_socket(args.host, args.port)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level.lower() != "debug":  # per-request chatter of libraries only when debugging
        for noisy in ("httpx", "httpcore", "transitions"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _setup_tracing(role: str, args: argparse.Namespace, install: bool = True) -> None:
    """Spans of this process (and of the children it starts) go where --trace-file says."""
    if args.trace_file:
        os.environ[TRACE_FILE_ENV] = os.path.abspath(args.trace_file)
    if install:
        setup_tracing(f"pdengine-{role}")


def _worker_main(role: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"pdengine {role}", description=f"run one {role} worker")
    _add_common(p, 0)
    _add_worker(p)
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    _setup_tracing(role, args)
    token = args.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV, "")
    if not token:
        p.error(f"a cluster token is required: --cluster-token or {CLUSTER_TOKEN_ENV}")
    from pdengine.server.app import create_worker_app

    sock = _socket_of(args)
    options: dict[str, Any] = {"advertise_url": args.advertise_url or url_of(sock),
                               "cluster_token": token}
    try:
        options.update(worker_options_from_env())  # PDENGINE_FAULTS, PDENGINE_DEADLINES
    except ValueError as exc:
        p.error(str(exc))
    app = create_worker_app(role, args.model, cluster_token=token, transport=args.transport,
                            settings=settings_of(args), worker_options=options)
    return run_app(app, sock, role, args.log_level)


def prefill_main(argv: list[str]) -> int:
    return _worker_main("prefill", argv)


def decode_main(argv: list[str]) -> int:
    return _worker_main("decode", argv)


def router_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdengine router",
                                description="route requests to prefill and decode workers")
    _add_common(p, 8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill worker's base URL (repeat for several)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode worker's base URL (repeat for several)")
    p.add_argument("--policy", choices=("round_robin", "least_loaded"), default="round_robin")
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    _setup_tracing("router", args)
    if not args.prefill or not args.decode:
        p.error("give at least one --prefill URL and one --decode URL")
    from pdengine.server.router_app import create_router_app

    app = create_router_app(args.prefill, args.decode, args.model, policy=args.policy,
                            settings=settings_of(args))
    return run_app(app, _socket_of(args), "router", args.log_level)


def serve_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pdengine serve",
        description="router + one prefill + one decode worker on this machine "
                    "(--colocated: one engine process, no transfer)")
    _add_common(p, 8000)
    _add_worker(p)
    p.add_argument("--colocated", action="store_true",
                   help="serve with the colocated engine in this process")
    p.add_argument("--policy", choices=("round_robin", "least_loaded"), default="round_robin")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    _setup_tracing("colocated", args, install=args.colocated)  # PD: the children trace
    if args.colocated:
        from pdengine.server.app import create_colocated_app

        app = create_colocated_app(args.model, settings=settings_of(args))
        return run_app(app, _socket_of(args), "serve", args.log_level)
    from pdengine.server.supervisor import serve_pd

    return serve_pd(args)
