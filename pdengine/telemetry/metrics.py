"""Prometheus metrics of one pdengine role (prefill, decode, colocated, router).

Each `Metrics` object owns its own `CollectorRegistry`, so several roles can
live in one process (tests, `Engine(mode="pd")`) without name clashes. Every
metric is prefixed `pdengine_` and carries the label `role`.

Usage::

    metrics = Metrics("prefill")
    room_actor = RoomActor(..., on_transition=metrics.on_room_transition)
    metrics.set_gauges(worker.stats())          # before each scrape, or periodically
    metrics.observe_kv_transfer(latency_ms=3.2, nbytes=1 << 20)
    metrics.observe_ttft(0.041); metrics.observe_inter_token(0.004)
    metrics.observe_e2e(0.9)
    body, content_type = metrics.render()       # GET /metrics

Methods
-------
- ``on_room_transition(room, trigger, src, dst, late)``: the FSM transition
  hook (``late`` is the FSM's "absorbed" flag). Counts ``late_events_total``
  for an event absorbed by a terminal room. When a room enters FAILED:
  a trigger containing ``abort`` counts ``num_aborted_requests_total`` only;
  any other failure counts ``num_bootstrap_failed_reqs_total`` if it left
  BOOTSTRAPPING, else ``num_transfer_failed_reqs_total``, and in addition
  ``room_timeouts_total`` for a ``timeout`` trigger and ``checksum_failures_total``
  when the trigger or ``room.reason`` mentions a checksum.
  States may be ``RoomState`` members, ints (KVPoll values) or names.
- ``set_gauges(stats)``: sets every gauge whose name (without prefix) is a key
  of ``stats``; ``stats["rooms"]`` (or ``"rooms_by_state"``) maps state name ->
  live room count (states seen before and now absent drop to 0). Unknown keys
  are ignored, so a worker may pass its whole ``stats()`` dict.
- ``observe_kv_transfer(latency_ms, nbytes)`` (latency and, when both are > 0,
  GB/s), ``observe_ttft(s)``, ``observe_inter_token(s)``, ``observe_e2e(s)``.
- ``inc_aborted()``, ``inc_bootstrap_failed()``, ``inc_transfer_failed()``,
  ``inc_late_event()``, ``inc_room_timeout()``, ``inc_checksum_failure()``:
  for the counters when no FSM transition carries the information.
- ``render() -> (bytes, content_type)``: the text exposition format.
- ``registry``: the `CollectorRegistry`; ``gauge_values()`` returns the
  current plain gauges as a dict (for tests and diagnostics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PREFIX = "pdengine_"

# `*_created` timestamp series double every counter and histogram for no operational use.
disable_created_metrics()

# Plain gauges, one value per role.
GAUGES: dict[str, str] = {
    "num_prefill_bootstrap_queue_reqs": "Prefill rooms waiting for the decode side's destination",
    "num_prefill_inflight_queue_reqs": "Prefill rooms whose KV writes are not all acknowledged",
    "num_decode_prealloc_queue_reqs": "Decode requests waiting for KV pages",
    "num_decode_transfer_queue_reqs": "Decode rooms waiting for their KV transfer",
    "num_running_reqs": "Requests in the running (decode) batch",
    "num_queue_reqs": "Requests waiting to be scheduled",
    "oldest_nonterminal_room_age_seconds": "Age of the oldest room not yet SUCCESS or FAILED",
    "kv_pages_used": "KV cache pages allocated",
}

COUNTERS: dict[str, str] = {
    "num_bootstrap_failed_reqs": "Rooms that failed during bootstrap",
    "num_transfer_failed_reqs": "Rooms that failed after bootstrap (transfer, peer, decode)",
    "num_aborted_requests": "Requests aborted (client disconnect, abort_request, peer abort)",
    "late_events": "Events absorbed by a room already in a terminal state",
    "room_timeouts": "Rooms failed by a deadline",
    "checksum_failures": "KV chunks whose checksum did not verify",
}

_MS_BUCKETS = (0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
_GBS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "kv_transfer_latency_ms": ("KV transfer latency of one room, ms", _MS_BUCKETS),
    "kv_transfer_speed_gb_s": ("KV transfer speed of one room, GB/s", _GBS_BUCKETS),
    "time_to_first_token_seconds": ("Time to first token", _TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive output tokens", _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Request latency from arrival to finish", _E2E_BUCKETS),
}

_STATE_NAMES = {
    0: "FAILED",
    1: "BOOTSTRAPPING",
    2: "WAITING_FOR_INPUT",
    3: "TRANSFERRING",
    4: "SUCCESS",
}


def state_name(state: Any) -> str:
    """`RoomState.FAILED`, 0, "failed" and "FAILED" all read as "FAILED"."""
    if state is None:
        return ""
    name = getattr(state, "name", None)
    if isinstance(name, str):
        return name.upper()
    if isinstance(state, int) and not isinstance(state, bool):
        return _STATE_NAMES.get(state, str(state))
    return str(state).rsplit(".", 1)[-1].upper()


class Metrics:
    """All pdengine metrics of one role, in a registry of their own."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry()
        self._gauges = {
            name: Gauge(PREFIX + name, doc, ["role"], registry=self.registry).labels(role=role)
            for name, doc in GAUGES.items()
        }
        self._rooms = Gauge(
            PREFIX + "rooms", "Live rooms by state", ["role", "state"], registry=self.registry
        )
        # live (non-terminal) states are always exposed, at 0 when there is no room
        self._room_states_seen: set[str] = {"BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING"}
        for state in self._room_states_seen:
            self._rooms.labels(role=role, state=state).set(0)
        self._counters = {
            name: Counter(PREFIX + name, doc, ["role"], registry=self.registry).labels(role=role)
            for name, doc in COUNTERS.items()
        }
        self._histograms = {
            name: Histogram(
                PREFIX + name, doc, ["role"], buckets=buckets, registry=self.registry
            ).labels(role=role)
            for name, (doc, buckets) in HISTOGRAMS.items()
        }

    # -- FSM hook ---------------------------------------------------------------------------

    def on_room_transition(self, room: Any, trigger: str, src: Any, dst: Any, late: bool) -> None:
        """Transition hook of the room FSM: count late events and failures by cause.

        `late` is the FSM's "absorbed" flag: an absorbed event on a terminal room
        is a late event; one absorbed on a live room (invalid order) is not counted.
        """
        if late:
            if state_name(src) in ("SUCCESS", "FAILED"):
                self._counters["late_events"].inc()
            return
        if state_name(dst) != "FAILED" or state_name(src) == "FAILED":
            return
        trig = (trigger or "").lower()
        reason = str(getattr(room, "reason", "") or "").lower()
        if "timeout" in trig:
            self._counters["room_timeouts"].inc()
        if "abort" in trig:
            self._counters["num_aborted_requests"].inc()
            return
        if "checksum" in trig or "checksum" in reason:
            self._counters["checksum_failures"].inc()
        if state_name(src) == "BOOTSTRAPPING":
            self._counters["num_bootstrap_failed_reqs"].inc()
        else:
            self._counters["num_transfer_failed_reqs"].inc()

    # -- gauges -----------------------------------------------------------------------------

    def set_gauges(self, stats: Mapping[str, Any]) -> None:
        """Set the gauges named by the keys of `stats` (unknown keys are ignored)."""
        for name, gauge in self._gauges.items():
            value = stats.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                gauge.set(value)
        rooms = stats.get("rooms", stats.get("rooms_by_state"))
        if isinstance(rooms, Mapping):
            counts = {state_name(k): v for k, v in rooms.items()}
            for state in self._room_states_seen | counts.keys():
                self._rooms.labels(role=self.role, state=state).set(counts.get(state, 0))
            self._room_states_seen |= counts.keys()

    def gauge_values(self) -> dict[str, float]:
        """Current value of every plain gauge (without the prefix)."""
        labels = {"role": self.role}
        return {
            name: self.registry.get_sample_value(PREFIX + name, labels) or 0.0
            for name in self._gauges
        }

    # -- histograms -------------------------------------------------------------------------

    def observe_kv_transfer(self, latency_ms: float, nbytes: int = 0) -> None:
        self._histograms["kv_transfer_latency_ms"].observe(latency_ms)
        if latency_ms > 0 and nbytes > 0:
            gb_per_s = nbytes / 1e9 / (latency_ms / 1000.0)
            self._histograms["kv_transfer_speed_gb_s"].observe(gb_per_s)

    def observe_ttft(self, seconds: float) -> None:
        self._histograms["time_to_first_token_seconds"].observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._histograms["inter_token_latency_seconds"].observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._histograms["e2e_request_latency_seconds"].observe(seconds)

    # -- counters ---------------------------------------------------------------------------

    def inc_aborted(self, n: int = 1) -> None:
        self._counters["num_aborted_requests"].inc(n)

    def inc_bootstrap_failed(self, n: int = 1) -> None:
        self._counters["num_bootstrap_failed_reqs"].inc(n)

    def inc_transfer_failed(self, n: int = 1) -> None:
        self._counters["num_transfer_failed_reqs"].inc(n)

    def inc_late_event(self, n: int = 1) -> None:
        self._counters["late_events"].inc(n)

    def inc_room_timeout(self, n: int = 1) -> None:
        self._counters["room_timeouts"].inc(n)

    def inc_checksum_failure(self, n: int = 1) -> None:
        self._counters["checksum_failures"].inc(n)

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format, with its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


METRIC_NAMES: tuple[str, ...] = tuple(
    PREFIX + n for n in (*GAUGES, "rooms", *(f"{c}_total" for c in COUNTERS), *HISTOGRAMS)
)
"""Every family name as it appears in the exposition (counters with `_total`)."""
