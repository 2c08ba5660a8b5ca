"""Checks every fault test ends with (issue 8): clear errors within the deadlines, no room left
non-terminal, no page leaked, new requests succeed, and `pdengine probe pins` is not stuck."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from rel_cluster import (
    QUARANTINE_BOUND_S,
    Cluster,
    StreamResult,
    prompt_of,
    stream_completion,
    wait_for,
)

from pdengine.server import probe

LONG_PROMPT = 1500  # > chunk_tokens (256): a multi-chunk transfer per request


class Load:
    """`n` concurrent streaming requests with long prompts, running in threads."""

    def __init__(self, url: str, n: int = 6, prompt_tokens: int = LONG_PROMPT,
                 max_tokens: int = 16, timeout_s: float = 90.0) -> None:
        self._pool = ThreadPoolExecutor(max_workers=n)
        self.started = time.monotonic()
        self.futures: list[Future[StreamResult]] = [
            self._pool.submit(stream_completion, url, prompt_of(prompt_tokens, i), max_tokens,
                              timeout_s)
            for i in range(n)
        ]

    def results(self, timeout_s: float) -> list[StreamResult | BaseException]:
        """Every request's outcome; fails (a hang) if one is not over within `timeout_s`."""
        out: list[StreamResult | BaseException] = []
        deadline = self.started + timeout_s
        for f in self.futures:
            try:
                out.append(f.result(timeout=max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                raise AssertionError(f"a request hung past {timeout_s}s") from None
            except Exception as exc:  # a transport error is a clear (client-side) failure
                out.append(exc)
        self._pool.shutdown(wait=False)
        return out


def assert_clear_outcomes(results: list[StreamResult | BaseException]) -> int:
    """Each request either succeeded or ended with a clear error (an HTTP error status, or
    an error event then [DONE]) — never a 200 stream that just stops. Returns the failures."""
    failed = 0
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"a request died without an answer: {r!r}")
        if r.ok:
            continue
        failed += 1
        if r.status == 200:
            assert r.error is not None and r.done, f"200 stream without a clear error: {r}"
            assert r.error.get("message"), r
        else:
            assert r.status >= 400 and r.error and r.error.get("message"), r
    return failed


def wait_in_flight(c: Cluster, state: str = "TRANSFERRING", timeout_s: float = 60.0) -> None:
    """Until some prefill room is in `state` (a transfer is in flight)."""

    def seen() -> bool:
        return any(r.get("state") == state and r.get("role", "prefill") == "prefill"
                   for r in c.live_rooms())

    wait_for(seen, timeout_s, f"a room in {state}\n{c.logs()}")


def probe_verdict(url: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = probe.main(["pins", "--url", url, "--samples", "3", "--interval", "0.4", "--json"])
    verdict = json.loads(out.getvalue())
    assert rc == 0, verdict
    return verdict


def assert_recovered(c: Cluster, requests: int = 3,
                     idle_timeout_s: float = QUARANTINE_BOUND_S) -> None:
    """Quiescent (no live room, no page used), then new requests succeed, then idle again and
    the probe says idle or healthy."""
    c.wait_idle(idle_timeout_s)
    assert c.live_rooms() == []
    results = [stream_completion(c.url, prompt_of(LONG_PROMPT // 2, 100 + i), 6)
               for i in range(requests)]
    assert all(r.ok for r in results), (results, c.logs())
    c.wait_idle(idle_timeout_s)
    assert probe_verdict(c.url)["verdict"] in ("idle", "healthy")


def in_thread(fn: Callable[[], object]) -> Future[object]:
    pool = ThreadPoolExecutor(max_workers=1)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    return fut
