#!/usr/bin/env python3
"""Abort storms and a soak of mixed traffic against a real `pdengine serve` (router + prefill +
decode processes), recording drain times and any pin or leaked page.

1. baseline: one round of `--requests` streams that all complete; the time from the last
   answer to every gauge idle is the baseline drain;
2. storm: `--rounds` x `--requests` streams with multi-chunk prompts, each cut off at a random
   point (`pdengine bench abort-storm`'s engine); drain time, pins, leaked pages per round;
3. soak: `--clients` concurrent clients for `--soak-seconds`, each request completing or being
   cut off at random; the oldest live room is sampled every second and must stay under the
   deadline bound (a pin would keep ageing), and the deployment must drain at the end.

    benchmarks/reliability_storm.py [--rounds 10] [--requests 200] [--soak-seconds 120]
                                    [--url URL] [--json]

Prints the storm's slowest drain against the baseline drain (ratio). Exit status 1 on a pin,
a leaked page, or a soak that does not drain.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager, suppress
from dataclasses import asdict
from typing import Any

import anyio
import httpx

from pdengine.fsm import RoomDeadlines
from pdengine.server.diagnostics_scrape import discover_workers, idle_report, scrape_all
from pdengine.server.diagnostics_storm import StormConfig, run_storm

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,self,sm")


@contextmanager
def served(model: str, log_path: str):
    """`pdengine serve` on a free loopback port until the block ends (its output: `log_path`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDENGINE_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdengine.cli", "serve", "--model", model,
                                 "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with suppress(httpx.HTTPError), httpx.Client(timeout=2, trust_env=False) as c:
                workers = c.get(f"{url}/debug/workers").json()["workers"]
                if len(workers) == 2 and all(w["healthy"] for w in workers):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdengine serve did not start (exit {proc.poll()})")
            time.sleep(0.3)
        yield url
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_idle(url: str, timeout_s: float) -> tuple[float, dict[str, float]]:
    """Seconds until every worker gauge is idle (held 0.6 s), and what stayed busy if not."""
    start = time.monotonic()
    idle_since = None
    busy: dict[str, float] = {}
    with httpx.Client(timeout=5, trust_env=False) as c:
        workers = discover_workers(c, url)
        while time.monotonic() - start < timeout_s:
            busy = idle_report(scrape_all(c, workers), 0.0)
            now = time.monotonic()
            if busy:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= 0.6:
                return idle_since - start, {}
            time.sleep(0.05)
    return time.monotonic() - start, busy


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                 cut_after_s: float | None) -> str:
    """One streaming completion; 'completed', 'aborted' (cut by us) or 'error'."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}

    async def consume() -> str:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return "error"
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"error"' in line:
                    return "error"
                if line.strip() == "data: [DONE]":
                    return "completed"
        return "error"

    try:
        if cut_after_s is None:
            return await consume()
        with anyio.move_on_after(cut_after_s):
            return await consume()
        return "aborted"
    except httpx.HTTPError:
        return "error"


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


async def baseline_round(url: str, requests: int, prompt_tokens: int, max_tokens: int
                         ) -> dict[str, Any]:
    rng = random.Random(1)
    outcomes: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=requests + 8)) as client:
        async def one() -> None:
            outcomes[await stream(client, url, prompt(rng, prompt_tokens), max_tokens, None)] += 1

        async with anyio.create_task_group() as tg:
            for _ in range(requests):
                tg.start_soon(one)
    drain_s, busy = await anyio.to_thread.run_sync(wait_idle, url, 60.0)
    return {"completed": outcomes["completed"], "errors": outcomes["error"],
            "drain_s": round(drain_s, 3), "still_busy": busy}


async def soak(url: str, seconds: float, clients: int, prompt_tokens: int, max_tokens: int
               ) -> dict[str, Any]:
    rng = random.Random(2)
    outcomes: Counter[str] = Counter()
    oldest_max = 0.0
    stop_at = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            cut = rng.uniform(0.05, 3.0) if rng.random() < 0.5 else None
            n = rng.randint(prompt_tokens // 4, prompt_tokens)
            outcomes[await stream(client, url, prompt(rng, n), max_tokens, cut)] += 1

    def oldest_room_age() -> float:
        with httpx.Client(timeout=5, trust_env=False) as c:
            scrapes = scrape_all(c, discover_workers(c, url))
        return max(s.total("oldest_nonterminal_room_age_seconds") for s in scrapes)

    async def watch() -> None:
        nonlocal oldest_max
        while time.monotonic() < stop_at:
            oldest_max = max(oldest_max, await anyio.to_thread.run_sync(oldest_room_age))
            await anyio.sleep(1.0)

    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(timeout=600, trust_env=False, limits=limits) as client, \
            anyio.create_task_group() as tg:
        tg.start_soon(watch)
        for _ in range(clients):
            tg.start_soon(client_loop, client)
    drain_s, busy = await anyio.to_thread.run_sync(wait_idle, url, 60.0)
    bound = RoomDeadlines().bound_s() + RoomDeadlines().bootstrap_s
    return {"seconds": seconds, "clients": clients, **dict(outcomes),
            "oldest_room_age_max_s": round(oldest_max, 3), "room_age_bound_s": bound,
            "drain_s": round(drain_s, 3), "still_busy": busy,
            "ok": not busy and oldest_max < bound}


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    base = await baseline_round(url, args.requests, args.prompt_tokens, args.max_tokens)
    storm = await run_storm(StormConfig(url=url, requests=args.requests, rounds=args.rounds,
                                        prompt_tokens=args.prompt_tokens,
                                        max_tokens=args.max_tokens, seed=args.seed,
                                        drain_timeout_s=60.0), not args.json)
    soaked = (await soak(url, args.soak_seconds, args.clients, args.prompt_tokens,
                         args.max_tokens) if args.soak_seconds > 0 else None)
    return {"bench": "reliability_storm", "baseline": base, "storm": asdict(storm),
            "soak": soaked,
            "storm_drain_vs_baseline": round(storm.drain_seconds_max
                                             / max(base["drain_s"], 1e-3), 2),
            "ok": storm.ok and not base["still_busy"] and (soaked is None or soaked["ok"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an existing router (default: start one)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=200, help="streams per round")
    p.add_argument("--prompt-tokens", type=int, default=600, help="> one 256-token chunk")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--soak-seconds", type=float, default=120.0,
                   help="mixed traffic duration (600+ for the 10-minute soak; 0: none)")
    p.add_argument("--clients", type=int, default=16, help="concurrent soak clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "pdengine-storm.log"),
                   help="where the started deployment's output goes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if min(args.rounds, args.requests, args.prompt_tokens, args.clients) < 1:
        p.error("counts must be >= 1")
    started = time.perf_counter()
    if args.url:
        result = anyio.run(run, args, args.url.rstrip("/"))
    else:
        with served(args.model, args.log) as url:
            try:
                result = anyio.run(run, args, url)
            except Exception:
                print(f"the deployment's log: {args.log}", file=sys.stderr)
                raise
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result))
    else:
        s, b = result["storm"], result["baseline"]
        print(f"baseline: {b['completed']} completed streams, drained in {b['drain_s']} s")
        print(f"storm: {s['rounds']} x {args.requests}: {s['aborted']} aborted {s['cuts']}, "
              f"{s['completed']} completed, {s['errors']} errors; pins {s['pins']}, leaked "
              f"pages {s['leaked_pages']}, slowest drain {s['drain_seconds_max']} s "
              f"({result['storm_drain_vs_baseline']}x the baseline drain)")
        if result["soak"]:
            k = result["soak"]
            print(f"soak: {k['seconds']:.0f} s x {k['clients']} clients: "
                  f"{k.get('completed', 0)} completed, {k.get('aborted', 0)} aborted, "
                  f"{k.get('error', 0)} errors; oldest live room {k['oldest_room_age_max_s']} s "
                  f"(bound {k['room_age_bound_s']} s); drained in {k['drain_s']} s")
        print(f"{'OK' if result['ok'] else 'FAILED'} in {result['elapsed_s']} s")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
