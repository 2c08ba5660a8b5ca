"""`pdengine probe pins`: tell a stuck KV-transfer pin from healthy load (DESIGN.md §1.7).

Operators used to poll two gauges by hand for a minute: prefill's inflight queue and decode's
running batch. A pin looks like "inflight stays at N > 0, decode running stays 0, and the oldest
non-terminal room keeps ageing". This command polls those gauges (plus the oldest room age)
from every worker behind a router, prints a timeline and a verdict:

- ``idle``: nothing in flight, nothing running, no live room;
- ``healthy``: the values move (rooms finish, decode runs);
- ``stuck``: the pin pattern above held for the whole window.

Exit code 0 for idle/healthy, 1 for stuck, 2 when the deployment cannot be read.
`judge` is a pure function of the samples so the verdict rules are unit-tested.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise

import httpx

from pdengine.server.diagnostics_scrape import (
    DiagnosticsError,
    Scrape,
    discover_workers,
    scrape_all,
)

DECODE_ROLES = ("decode", "colocated")
# The oldest room must age by at least this share of the window to count as "not progressing"
# (a room that finished and was replaced would restart the age near 0).
AGEING_SHARE = 0.5


@dataclass(frozen=True)
class PinSample:
    t: float  # seconds since the first sample
    inflight: float  # prefill inflight queue, summed over prefill workers
    running: float  # running requests, summed over decode workers
    oldest_age_s: float  # oldest non-terminal room age, max over workers


@dataclass(frozen=True)
class Verdict:
    verdict: str  # "idle" | "healthy" | "stuck"
    reason: str

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "stuck" else 0


def judge(samples: Sequence[PinSample]) -> Verdict:
    """The verdict for a window of samples (at least two, in time order)."""
    if len(samples) < 2:
        raise ValueError("judge needs at least two samples")
    first, last = samples[0], samples[-1]
    if all(s.inflight == 0 and s.running == 0 and s.oldest_age_s == 0 for s in samples):
        return Verdict("idle", "nothing in flight, nothing running, no live room")
    window = last.t - first.t
    running_ever = any(s.running > 0 for s in samples)
    inflight_pinned = first.inflight > 0 and all(s.inflight == first.inflight for s in samples)
    ages = [s.oldest_age_s for s in samples]
    never_reset = all(b >= a for a, b in pairwise(ages))
    aged = ages[-1] - ages[0] >= AGEING_SHARE * window > 0
    if inflight_pinned and not running_ever and never_reset and aged:
        return Verdict(
            "stuck",
            f"prefill inflight constant at {first.inflight:g} for {window:.1f}s while decode "
            f"running stayed 0 and the oldest room aged to {last.oldest_age_s:.1f}s",
        )
    if running_ever:
        return Verdict("healthy", "decode is running requests")
    if not never_reset:
        return Verdict("healthy", "rooms finish (the oldest room age went down)")
    if not inflight_pinned:
        return Verdict("healthy", "prefill inflight moves")
    return Verdict("healthy", "the oldest room is not ageing with the clock")


def sample_from(scrapes: Sequence[Scrape], t: float) -> PinSample:
    return PinSample(
        t=t,
        inflight=sum(s.total("num_prefill_inflight_queue_reqs") for s in scrapes),
        running=sum(s.total("num_running_reqs", roles=DECODE_ROLES) for s in scrapes),
        oldest_age_s=max((s.total("oldest_nonterminal_room_age_seconds") for s in scrapes),
                         default=0.0),
    )


def poll(url: str, samples: int, interval: float, timeout: float = 5.0) -> list[PinSample]:
    """`samples` readings `interval` seconds apart from every worker behind `url`."""
    out: list[PinSample] = []
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        workers = discover_workers(client, url)
        start = time.monotonic()
        for i in range(samples):
            if i:
                time.sleep(max(0.0, start + i * interval - time.monotonic()))
            out.append(sample_from(scrape_all(client, workers), time.monotonic() - start))
    return out


def format_timeline(samples: Sequence[PinSample]) -> str:
    lines = [f"{'t(s)':>7} {'inflight':>9} {'running':>8} {'oldest_room_s':>14}"]
    lines += [
        f"{s.t:7.1f} {s.inflight:9g} {s.running:8g} {s.oldest_age_s:14.1f}" for s in samples
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdengine probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    pins = sub.add_parser("pins", help="stuck-pin check from the paired gauges")
    pins.add_argument("--url", default="http://127.0.0.1:8000", help="router or worker URL")
    pins.add_argument("--samples", type=int, default=8, help="readings to take (>= 2)")
    pins.add_argument("--interval", type=float, default=7.0, help="seconds between readings")
    pins.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.samples < 2 or args.samples > 1000 or not 0 < args.interval <= 600:
        print("probe pins: --samples must be in [2, 1000], --interval in (0, 600]", file=sys.stderr)
        return 2
    try:
        samples = poll(args.url, args.samples, args.interval)
    except DiagnosticsError as exc:
        print(f"probe pins: {exc}", file=sys.stderr)
        return 2
    verdict = judge(samples)
    if args.json:
        print(json.dumps({**asdict(verdict), "samples": [asdict(s) for s in samples]}))
    else:
        print(format_timeline(samples))
        print(f"verdict: {verdict.verdict} ({verdict.reason})")
    return verdict.exit_code
