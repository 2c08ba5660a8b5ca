"""The router is SIGKILLed while streams are open, then restarted.

Its clients lose their connections (the only possible answer from a dead process); the
workers see the router's upstream connections drop, abort every room on both sides and end
idle. The restarted router serves new requests and `probe pins` is not stuck.
"""

from __future__ import annotations

import pytest
from rel_checks import Load, assert_recovered
from rel_cluster import QUARANTINE_BOUND_S, StreamResult, cluster, wait_for

pytestmark = pytest.mark.timeout(420)


@pytest.mark.slow
def test_router_restart_with_open_streams(tmp_path) -> None:
    with cluster(tmp_path) as c:
        load = Load(c.url, n=4, prompt_tokens=600, max_tokens=400)
        wait_for(lambda: c.counter(c.decode, "num_running_reqs") >= 1, 90.0,
                 f"streams decoding\n{c.logs()}")
        c.router.kill()
        results = load.results(60.0)
        # No client got a 200 stream that claimed to be complete.
        assert not any(isinstance(r, StreamResult) and r.ok for r in results), results
        c.wait_idle(QUARANTINE_BOUND_S)
        assert c.prefill.alive and c.decode.alive
        c.router.start()
        c.router.wait_ready()
        c.wait_router_sees_workers()
        assert_recovered(c)
