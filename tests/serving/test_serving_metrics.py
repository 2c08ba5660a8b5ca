"""pdengine.telemetry.metrics: names, the FSM hook, gauges, and real exposition parsing."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from pdengine.fsm import Room
from pdengine.telemetry.metrics import METRIC_NAMES, Metrics, state_name


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_issue_metric_is_exposed_with_role_label() -> None:
    m = Metrics("decode")
    m.set_gauges({"rooms": {"TRANSFERRING": 1}})
    body, _ = m.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in METRIC_NAMES:
        # the parser strips `_total` from counter family names
        family = families.get(name.removesuffix("_total"))
        assert family is not None, name
        assert all(s.labels.get("role") == "decode" for s in family.samples), name
    assert families["pdengine_time_to_first_token_seconds"].type == "histogram"
    assert families["pdengine_late_events"].type == "counter"


def test_two_roles_in_one_process_do_not_clash() -> None:
    a, b = Metrics("prefill"), Metrics("decode")
    a.set_gauges({"kv_pages_used": 7})
    assert a.gauge_values()["kv_pages_used"] == 7
    assert b.gauge_values()["kv_pages_used"] == 0


def test_transition_hook_counts_by_cause() -> None:
    m = Metrics("prefill")
    room = SimpleNamespace(room_id=1, reason="")
    m.on_room_transition(room, "abort", 3, 0, False)
    m.on_room_transition(room, "timeout", 1, 0, False)
    m.on_room_transition(room, "fail", "TRANSFERRING", "FAILED", False)
    m.on_room_transition(SimpleNamespace(reason="checksum mismatch"), "fail", 3, 0, False)
    m.on_room_transition(room, "chunk_done", 0, 0, True)
    m.on_room_transition(room, "succeed", 1, 1, True)  # absorbed on a live room: not late
    m.on_room_transition(room, "bootstrapped", 1, 2, False)  # not a failure: no counter
    s = _samples(m)
    role = (("role", "prefill"),)
    assert s[("pdengine_num_aborted_requests_total", role)] == 1
    assert s[("pdengine_room_timeouts_total", role)] == 1
    assert s[("pdengine_num_bootstrap_failed_reqs_total", role)] == 1  # the timeout
    assert s[("pdengine_num_transfer_failed_reqs_total", role)] == 2
    assert s[("pdengine_checksum_failures_total", role)] == 1
    assert s[("pdengine_late_events_total", role)] == 1


def test_room_state_gauge_drops_absent_states_to_zero() -> None:
    m = Metrics("decode")
    m.set_gauges({"rooms": {"TRANSFERRING": 2, 1: 1}, "num_running_reqs": 3, "other": "x"})
    s = _samples(m)
    assert s[("pdengine_rooms", (("role", "decode"), ("state", "TRANSFERRING")))] == 2
    assert s[("pdengine_rooms", (("role", "decode"), ("state", "BOOTSTRAPPING")))] == 1
    m.set_gauges({"rooms": {}})
    s = _samples(m)
    assert s[("pdengine_rooms", (("role", "decode"), ("state", "TRANSFERRING")))] == 0
    assert m.gauge_values()["num_running_reqs"] == 3


def test_histograms_observe() -> None:
    m = Metrics("decode")
    m.observe_kv_transfer(latency_ms=2.0, nbytes=4_000_000)  # 2 GB/s
    m.observe_ttft(0.03)
    m.observe_inter_token(0.002)
    m.observe_e2e(0.4)
    s = _samples(m)
    role = (("role", "decode"),)
    assert s[("pdengine_kv_transfer_speed_gb_s_sum", role)] == 2.0
    assert s[("pdengine_kv_transfer_latency_ms_count", role)] == 1
    assert s[("pdengine_time_to_first_token_seconds_sum", role)] == 0.03
    assert s[("pdengine_e2e_request_latency_seconds_count", role)] == 1


def test_state_name_normalises() -> None:
    assert state_name(0) == state_name("failed") == state_name("RoomState.FAILED") == "FAILED"
    assert state_name(SimpleNamespace(name="success")) == "SUCCESS"


def test_hook_driven_by_a_real_room() -> None:
    m = Metrics("decode")
    room = Room(5, "decode", hook=m.on_room_transition)
    room.bootstrap()
    room.reason = "checksum mismatch in chunk 0"
    room.fail()
    room.chunk_done()  # late: the room is FAILED
    room.abort()  # late as well; not an abort of a live request
    s = _samples(m)
    role = (("role", "decode"),)
    assert s[("pdengine_checksum_failures_total", role)] == 1
    assert s[("pdengine_num_transfer_failed_reqs_total", role)] == 1
    assert s[("pdengine_late_events_total", role)] == 2
    assert s[("pdengine_num_aborted_requests_total", role)] == 0
