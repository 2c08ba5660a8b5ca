"""Reading worker gauges from the real Prometheus exposition of `Metrics`."""

from __future__ import annotations

from pdengine.server.diagnostics_scrape import WorkerRef, idle_report, parse_exposition
from pdengine.server.diagnostics_storm import pins_in
from pdengine.server.probe import sample_from
from pdengine.telemetry.metrics import Metrics


def scrape_of(role: str, **stats):
    metrics = Metrics(role)
    metrics.set_gauges(stats)
    body, _ = metrics.render()
    return parse_exposition(WorkerRef(role, f"http://127.0.0.1/{role}"), body.decode())


def test_idle_workers_report_nothing_busy() -> None:
    scrapes = [scrape_of("prefill", rooms={"TRANSFERRING": 0}), scrape_of("decode")]
    assert idle_report(scrapes) == {}
    assert pins_in({}) == 0


def test_a_pinned_pair_is_reported_with_its_pages() -> None:
    prefill = scrape_of("prefill", num_prefill_inflight_queue_reqs=1, kv_pages_used=38,
                        oldest_nonterminal_room_age_seconds=12.5, rooms={"TRANSFERRING": 1})
    decode = scrape_of("decode", num_decode_transfer_queue_reqs=1, kv_pages_used=38,
                       rooms={"WAITING_FOR_INPUT": 1, "SUCCESS": 0})
    busy = idle_report([prefill, decode], baseline_pages=0.0)
    assert busy["num_prefill_inflight_queue_reqs"] == 1
    assert busy["kv_pages_used_above_idle"] == 76
    assert busy["nonterminal_rooms"] == 2
    assert pins_in(busy) == 2
    assert "kv_pages_used_above_idle" not in idle_report([prefill, decode], baseline_pages=None)


def test_pages_alone_are_a_leak_not_a_pin() -> None:
    busy = idle_report([scrape_of("decode", kv_pages_used=3)], baseline_pages=0.0)
    assert busy == {"kv_pages_used_above_idle": 3}
    assert pins_in(busy) == 0


def test_probe_sample_pairs_prefill_inflight_with_decode_running() -> None:
    prefill = scrape_of("prefill", num_prefill_inflight_queue_reqs=2, num_running_reqs=5,
                        oldest_nonterminal_room_age_seconds=4.0)
    decode = scrape_of("decode", num_running_reqs=3, oldest_nonterminal_room_age_seconds=9.0)
    sample = sample_from([prefill, decode], t=1.5)
    # prefill's own batch is not decode progress: only decode/colocated running counts
    assert (sample.inflight, sample.running, sample.oldest_age_s) == (2, 3, 9.0)
