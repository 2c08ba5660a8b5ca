"""Abort storm: many streaming requests cut off mid-flight, then a leak and pin check.

One round:
1. fire `requests` concurrent streaming completions with long prompts (multi-chunk transfers);
2. each client disconnects at a random point: before its first token (the cut time is drawn
   from first-token latencies seen so far, so it lands while prefill and the KV transfer run),
   or mid-decode after a random number of tokens; a stream that ends first counts as completed;
3. wait for quiescence: every worker gauge back to idle, KV pages back to the idle baseline;
   what is still busy after `drain_timeout` is reported as pins and leaked pages.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx

from pdengine.server.diagnostics_scrape import (
    DiagnosticsError,
    WorkerRef,
    discover_workers,
    idle_report,
    scrape_all,
)

CUT_BEFORE_FIRST_TOKEN = "before_first_token"
CUT_MID_DECODE = "mid_decode"
SETTLE_S = 0.6  # idle must hold this long (longer than a worker's gauge refresh period)


@dataclass(frozen=True)
class StormConfig:
    url: str
    requests: int = 100
    rounds: int = 5
    prompt_tokens: int = 2000
    max_tokens: int = 32
    seed: int = 0
    drain_timeout_s: float = 30.0
    request_timeout_s: float = 120.0


@dataclass
class StormResult:
    rounds: int = 0
    requests: int = 0
    aborted: int = 0
    completed: int = 0
    errors: int = 0
    pins: int = 0
    leaked_pages: int = 0
    drain_seconds_max: float = 0.0
    cuts: dict[str, int] = field(default_factory=dict)  # where the aborted streams were cut
    error_kinds: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)  # first message of each kind
    still_busy: dict[str, float] = field(default_factory=dict)  # gauges not idle at the end

    @property
    def ok(self) -> bool:
        return self.pins == 0 and self.leaked_pages == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class _Outcome:
    kind: str  # "aborted" | "completed" | "error"
    cut: str = ""
    first_token_s: float | None = None
    error: str = ""
    detail: str = ""


def _payload(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def _one_stream(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    cut_after_s: float | None,
    cut_after_tokens: int | None,
) -> _Outcome:
    """Stream one completion and disconnect at the planned point."""
    start = time.monotonic()
    first: list[float] = []
    tokens = 0

    async def consume() -> _Outcome:
        nonlocal tokens
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return _Outcome("error", error=f"http {resp.status_code}", detail=body[:300])
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return _Outcome("completed", first_token_s=first[0] if first else None)
                try:
                    chunk = json.loads(data)
                except ValueError:
                    return _Outcome("error", error="malformed event", detail=data[:300])
                if "error" in chunk and not chunk.get("choices"):
                    return _Outcome("error", error="error event in stream", detail=data[:300])
                if not first:
                    first.append(time.monotonic() - start)
                tokens += 1  # one event carries one delta (a token, or a few)
                if cut_after_tokens is not None and tokens >= cut_after_tokens:
                    return _Outcome("aborted", CUT_MID_DECODE, first[0])  # closes the stream
            return _Outcome("error", error="stream ended without [DONE]")

    try:
        if cut_after_s is None:
            return await consume()
        with anyio.move_on_after(cut_after_s):
            return await consume()
        # Cancelled: httpx drops the half-read connection, the server sees the disconnect.
        cut = CUT_MID_DECODE if first else CUT_BEFORE_FIRST_TOKEN
        return _Outcome("aborted", cut, first[0] if first else None)
    except httpx.HTTPError as exc:
        return _Outcome("error", error=type(exc).__name__, detail=str(exc)[:300])


async def _wait_idle(
    client: httpx.Client, workers: list[WorkerRef], baseline_pages: float | None, timeout_s: float
) -> tuple[float, dict[str, float]]:
    """Seconds until every worker is idle, and what is still busy if it never gets there.

    Workers refresh their gauges periodically, so idle only counts once it held for
    `SETTLE_S`; the drain time is when that idle streak began.
    """
    start = time.monotonic()
    busy: dict[str, float] = {}
    idle_since: float | None = None
    while (now := time.monotonic()) - start < timeout_s + SETTLE_S:
        scrapes = await anyio.to_thread.run_sync(scrape_all, client, workers)
        busy = idle_report(scrapes, baseline_pages)
        if busy:
            idle_since = None
            if now - start >= timeout_s:
                break
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= SETTLE_S:
            return idle_since - start, {}
        await anyio.sleep(0.05)
    return time.monotonic() - start, busy


class _Progress:
    def __init__(self, enabled: bool, rounds: int, requests: int) -> None:
        self.enabled, self.rounds, self.requests = enabled, rounds, requests

    def show(self, round_no: int, done: int, outcomes: Counter[str], note: str = "") -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // max(1, self.requests)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(
            f"\rround {round_no}/{self.rounds} [{bar}] {done}/{self.requests} "
            f"aborted {outcomes['aborted']} completed {outcomes['completed']} "
            f"errors {outcomes['error']} {note:<24}"
        )
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_storm(cfg: StormConfig, progress: bool = True) -> StormResult:
    """Run the storm against `cfg.url` (a router) and return what was measured."""
    rng = random.Random(cfg.seed)
    result = StormResult()
    bar = _Progress(progress, cfg.rounds, cfg.requests)
    limits = httpx.Limits(max_connections=cfg.requests + 8, max_keepalive_connections=8)
    with httpx.Client(timeout=10.0, trust_env=False) as sync_client:
        workers = discover_workers(sync_client, cfg.url)
        _, busy = await _wait_idle(sync_client, workers, None, cfg.drain_timeout_s)
        if busy:
            raise DiagnosticsError(f"deployment is not idle before the storm: {busy}")
        # Pages a quiet deployment holds (normally 0): the level every round must return to.
        baseline_pages = sum(s.total("kv_pages_used") for s in scrape_all(sync_client, workers))
        async with httpx.AsyncClient(
            timeout=cfg.request_timeout_s, limits=limits, trust_env=False
        ) as client:
            warm = await _one_stream(
                client, cfg.url, _payload(_prompt(rng, cfg.prompt_tokens), 2), None, None
            )
            if warm.kind != "completed" or warm.first_token_s is None:
                why = f"{warm.error or warm.kind} {warm.detail}".strip()
                raise DiagnosticsError(f"warm-up request failed: {why}")
            first_token_times = [warm.first_token_s]
            for round_no in range(1, cfg.rounds + 1):
                outcomes = await _round(client, cfg, rng, first_token_times, round_no, bar)
                bar.show(round_no, cfg.requests, Counter(o.kind for o in outcomes), "draining")
                drain_s, busy = await _wait_idle(
                    sync_client, workers, baseline_pages, cfg.drain_timeout_s
                )
                _account(result, outcomes, drain_s, busy)
    bar.end()
    return result


def _prompt(rng: random.Random, n: int) -> list[int]:
    # Byte-range ids: valid token ids for any vocabulary of at least 256 entries.
    return [rng.randrange(32, 127) for _ in range(n)]


async def _round(
    client: httpx.AsyncClient,
    cfg: StormConfig,
    rng: random.Random,
    first_token_times: list[float],
    round_no: int,
    bar: _Progress,
) -> list[_Outcome]:
    outcomes: list[_Outcome] = []
    tally: Counter[str] = Counter()
    # Pre-token cuts spread over the time the round's prefills and transfers take: prefill is
    # compute-bound, so n concurrent prompts need about n times the warm-up's first-token
    # latency; later rounds also use the first-token latencies they saw.
    horizon = max(max(first_token_times), first_token_times[0] * cfg.requests) * 1.1

    async def one(plan: tuple[float | None, int | None], prompt: list[int]) -> None:
        outcome = await _one_stream(client, cfg.url, _payload(prompt, cfg.max_tokens), *plan)
        outcomes.append(outcome)
        tally[outcome.kind] += 1
        bar.show(round_no, len(outcomes), tally)

    async with anyio.create_task_group() as tg:
        for _ in range(cfg.requests):
            if rng.random() < 0.5:
                plan: tuple[float | None, int | None] = (rng.uniform(0.0, horizon), None)
            else:
                plan = (None, rng.randint(1, max(1, cfg.max_tokens - 1)))
            tg.start_soon(one, plan, _prompt(rng, cfg.prompt_tokens))
    first_token_times.extend(o.first_token_s for o in outcomes if o.first_token_s is not None)
    return outcomes


def _account(
    result: StormResult, outcomes: list[_Outcome], drain_s: float, busy: dict[str, float]
) -> None:
    result.rounds += 1
    result.requests += len(outcomes)
    for o in outcomes:
        if o.kind == "aborted":
            result.aborted += 1
            result.cuts[o.cut] = result.cuts.get(o.cut, 0) + 1
        elif o.kind == "completed":
            result.completed += 1
        else:
            result.errors += 1
            result.error_kinds[o.error] = result.error_kinds.get(o.error, 0) + 1
            result.error_examples.setdefault(o.error, o.detail)
    result.drain_seconds_max = max(result.drain_seconds_max, round(drain_s, 3))
    if busy:
        result.pins += pins_in(busy)
        result.leaked_pages += int(abs(busy.get("kv_pages_used_above_idle", 0.0)))
        result.still_busy = busy


def pins_in(busy: dict[str, float]) -> int:
    """Requests still held after the drain: live rooms, or the fullest non-idle queue gauge."""
    queues = [v for k, v in busy.items() if k.startswith("num_")]
    aged = 1.0 if busy.get("oldest_nonterminal_room_age_seconds") else 0.0
    return int(max([busy.get("nonterminal_rooms", 0.0), aged, *queues]))

