"""A real pin: the fault transport stalls every KV write and the deadlines are raised, so one
request sits in the prefill inflight queue. `pdengine probe pins` must call it stuck."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from obs_serve_helpers import running_serve, wait_for

from pdengine.server import probe
from pdengine.server.diagnostics_scrape import discover_workers, scrape_all

pytestmark = pytest.mark.timeout(240)

STALLED = {
    "PDENGINE_FAULTS": "stall_write=1.0",
    # far above the probe window: the pin must still be there when the probe looks
    "PDENGINE_DEADLINES": "bootstrap_s=600,waiting_for_input_s=600,transfer_progress_s=600,"
                          "write_s=600",
}


def _inflight(url: str) -> float:
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        scrapes = scrape_all(client, discover_workers(client, url))
    return sum(s.total("num_prefill_inflight_queue_reqs") for s in scrapes)


def test_probe_says_stuck_on_a_stalled_transfer(tmp_path, capsys) -> None:
    with running_serve(tmp_path, env=STALLED) as served:
        stop = threading.Event()

        def pinned_request() -> None:
            body = {"prompt": [98] * 300, "max_tokens": 4, "temperature": 0.0, "stream": True}
            try:
                with httpx.Client(timeout=httpx.Timeout(5.0, read=None), trust_env=False) as c, \
                        c.stream("POST", f"{served.url}/v1/completions", json=body) as resp:
                    for _ in resp.iter_lines():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass

        client_thread = threading.Thread(target=pinned_request, daemon=True)
        client_thread.start()
        wait_for(lambda: _inflight(served.url) >= 1, 60.0, f"the pin\n{served.log_tail()}")
        rc = probe.main(
            ["pins", "--url", served.url, "--samples", "4", "--interval", "0.6", "--json"]
        )
        out = json.loads(capsys.readouterr().out)
        stop.set()
        assert (rc, out["verdict"]) == (1, "stuck"), out
        assert all(s["inflight"] == 1 and s["running"] == 0 for s in out["samples"])
        ages = [s["oldest_age_s"] for s in out["samples"]]
        assert ages == sorted(ages) and ages[-1] - ages[0] >= 1.0
