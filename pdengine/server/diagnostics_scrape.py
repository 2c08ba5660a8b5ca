"""Reading a running deployment for the diagnostics commands (`probe`, `bench`).

`discover_workers` asks a router for its workers (GET /debug/workers) or, when the URL is a
worker itself, uses it directly. `scrape` reads one worker's /metrics into a `Scrape`, which
sums gauges by name and role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "pdengine_"
NON_TERMINAL_STATES = ("BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING")
# Gauges that must read 0 when a deployment is quiescent (DESIGN.md I4).
IDLE_GAUGES = (
    "num_prefill_bootstrap_queue_reqs",
    "num_prefill_inflight_queue_reqs",
    "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs",
    "num_running_reqs",
    "num_queue_reqs",
    "oldest_nonterminal_room_age_seconds",
)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class DiagnosticsError(RuntimeError):
    """The deployment could not be read (unreachable, not a pdengine server, bad answer)."""


@dataclass(frozen=True)
class WorkerRef:
    role: str
    url: str


@dataclass
class Scrape:
    """One /metrics scrape: (metric sample name, labels) -> value."""

    worker: WorkerRef
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def total(self, name: str, roles: tuple[str, ...] | None = None, **labels: str) -> float:
        """Sum of `pdengine_<name>` over samples whose role is in `roles` and labels match."""
        full = name if name.startswith(PREFIX) else PREFIX + name
        value = 0.0
        for (sample, sample_labels), v in self.samples.items():
            if sample != full:
                continue
            lab = dict(sample_labels)
            if roles is not None and lab.get("role") not in roles:
                continue
            if all(lab.get(k) == want for k, want in labels.items()):
                value += v
        return value

    def nonterminal_rooms(self) -> float:
        return sum(self.total("rooms", state=s) for s in NON_TERMINAL_STATES)


def is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in LOOPBACK_HOSTS


def _base(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def discover_workers(client: httpx.Client, url: str) -> list[WorkerRef]:
    """The prefill/decode workers behind a router URL, or the URL itself if it is a worker."""
    base = _base(url)
    try:
        resp = client.get(f"{base}/debug/workers")
    except httpx.HTTPError as exc:
        raise DiagnosticsError(f"cannot reach {base}: {exc}") from exc
    if resp.status_code == 200:
        body = resp.json()
        entries = body.get("workers", []) if isinstance(body, dict) else body
        workers = [
            WorkerRef(role=str(w.get("role", "")), url=_base(str(w["url"])))
            for w in entries
            if isinstance(w, dict) and w.get("url") and w.get("role") != "router"
        ]
        if workers:
            return workers
        raise DiagnosticsError(f"{base}/debug/workers lists no workers")
    return [WorkerRef(role="", url=base)]  # not a router: read this worker directly


def scrape(client: httpx.Client, worker: WorkerRef) -> Scrape:
    try:
        resp = client.get(f"{worker.url}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise DiagnosticsError(f"cannot read {worker.url}/metrics: {exc}") from exc
    result = parse_exposition(worker, resp.text)
    if not result.samples:
        raise DiagnosticsError(f"{worker.url}/metrics has no pdengine_ metrics")
    return result


def parse_exposition(worker: WorkerRef, text: str) -> Scrape:
    """The pdengine_ samples of a Prometheus text exposition."""
    result = Scrape(worker)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX):
                key = (s.name, tuple(sorted(s.labels.items())))
                result.samples[key] = result.samples.get(key, 0.0) + float(s.value)
    return result


def scrape_all(client: httpx.Client, workers: list[WorkerRef]) -> list[Scrape]:
    return [scrape(client, w) for w in workers]


def idle_report(scrapes: list[Scrape], baseline_pages: float | None = 0.0) -> dict[str, float]:
    """Non-idle gauges summed over workers (empty when idle), plus live rooms and the KV pages
    above `baseline_pages` (not checked when it is None)."""
    busy = {name: sum(s.total(name) for s in scrapes) for name in IDLE_GAUGES}
    busy = {name: v for name, v in busy.items() if v}
    if baseline_pages is not None:
        pages = sum(s.total("kv_pages_used") for s in scrapes) - baseline_pages
        if pages:
            busy["kv_pages_used_above_idle"] = pages
    rooms = sum(s.nonterminal_rooms() for s in scrapes)
    if rooms:
        busy["nonterminal_rooms"] = rooms
    return busy
