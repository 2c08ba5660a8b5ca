#!/usr/bin/env python3
"""Serving load: `pdengine serve` (PD: router + prefill + decode, NIXL) vs `--colocated`.

Both servers are started by this script on 127.0.0.1 (one after the other, same
model, same requests), loaded by N concurrent streaming clients with mixed prompt
lengths, and stopped. Reported per mode: TTFT p50/p99, inter-token latency
p50/p99, end-to-end p50, output tokens/s; and the PD/colocated ratio of each.
The work is bounded: a fixed request count and a wall-clock limit per mode.

    benchmarks/serving.py [--clients 32] [--requests 64] [--prompt-lens 16,128,512]
                          [--max-tokens 16] [--time-limit 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from pdengine.server.supervisor import die_with_parent

MAX_REQUESTS = 2000
HOST = "127.0.0.1"


@dataclass
class RequestTiming:
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def start_server(mode: str, model: str, timeout_s: float) -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, "-m", "pdengine.cli", "serve", "--host", HOST, "--port", "0",
            "--model", model]
    if mode == "colocated":
        args.append("--colocated")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=die_with_parent())  # never outlives the benchmark
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("pdengine ready: "):
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"pdengine serve ({mode}) did not start")


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int
                      ) -> RequestTiming:
    timing = RequestTiming()
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                timing.error = f"HTTP {r.status_code}"
                return timing
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    timing.error = obj["error"].get("message", "error")
                    break
                now = time.perf_counter()
                n = len(obj["output_ids"]) - timing.tokens
                if n <= 0:
                    continue
                if timing.ttft_s is None:
                    timing.ttft_s = now - start
                else:
                    timing.itl_s.extend([(now - last) / n] * n)
                timing.tokens += n
                last = now
    except httpx.HTTPError as exc:
        timing.error = type(exc).__name__
    timing.e2e_s = time.perf_counter() - start
    return timing


async def run_load(url: str, prompts: list[list[int]], clients: int, max_tokens: int,
                   time_limit_s: float) -> dict[str, Any]:
    timings: list[RequestTiming] = []
    queue = list(prompts)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None), limits=limits) as client:
        for warm in prompts[:2]:  # load code paths (and the NIXL registration) once
            await one_request(client, url, warm, 2)
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                timings.append(await one_request(client, url, queue.pop(), max_tokens))

        with anyio.move_on_after(time_limit_s):
            async with anyio.create_task_group() as tg:
                for _ in range(clients):
                    tg.start_soon(worker)
        wall = time.perf_counter() - start
    ok = [t for t in timings if t.error is None and t.ttft_s is not None]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    itl = [x for t in ok for x in t.itl_s]
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(prompts), "completed": len(ok),
        "errors": len(timings) - len(ok), "unfinished": len(prompts) - len(timings),
        "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 2),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 2),
        "itl_p50_ms": round(percentile(itl, 50) * 1e3, 2),
        "itl_p99_ms": round(percentile(itl, 99) * 1e3, 2),
        "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 2) if itl else float("nan"),
        "e2e_p50_ms": round(percentile([t.e2e_s for t in ok], 50) * 1e3, 2),
    }


def make_prompts(n: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-lens", default="16,128,512", help="comma-separated, cycled")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS or not 1 <= args.clients <= args.requests:
        p.error(f"need 1 <= clients <= requests <= {MAX_REQUESTS}")
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    prompts = make_prompts(args.requests, lengths, 250, args.seed)

    results: dict[str, Any] = {}
    for mode in ("colocated", "pd"):
        proc, url = start_server(mode, args.model, 300.0)
        try:
            results[mode] = anyio.run(run_load, url, prompts, args.clients, args.max_tokens,
                                      args.time_limit)
        finally:
            stop_server(proc)

    pd, co = results["pd"], results["colocated"]

    def ratio(key: str) -> float:
        return round(pd[key] / co[key], 3) if co[key] else float("nan")

    report = {
        "benchmark": "serving", "model": args.model, "clients": args.clients,
        "requests": args.requests, "prompt_lens": lengths, "max_tokens": args.max_tokens,
        "pd": pd, "colocated": co,
        "ratio_pd_over_colocated": {k: ratio(k) for k in (
            "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")},
    }
    if args.json:
        print(json.dumps(report))
    else:
        cols = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "e2e_p50_ms", "completed", "errors")
        print(f"{'mode':<10}" + "".join(f"{c:>14}" for c in cols))
        for mode in ("pd", "colocated"):
            print(f"{mode:<10}" + "".join(f"{results[mode][c]:>14}" for c in cols))
        r = report["ratio_pd_over_colocated"]
        print("PD/colocated: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    failed = pd["errors"] + co["errors"] + pd["unfinished"] + co["unfinished"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
