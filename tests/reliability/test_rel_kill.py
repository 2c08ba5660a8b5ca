"""SIGKILL one worker while KV transfers are in flight (three real processes on 127.0.0.1).

Each test: the affected requests end with a clear error within the deadlines (no hang), the
surviving worker holds no non-terminal room and no KV page, and after the killed role is
restarted at the same address new requests succeed and `pdengine probe pins` is not stuck.
"""

from __future__ import annotations

import pytest
from rel_checks import Load, assert_clear_outcomes, assert_recovered, wait_in_flight
from rel_cluster import cluster

pytestmark = pytest.mark.timeout(420)

# Deadlines of rel_cluster.FAST_DEADLINES plus liveness (3 missed 1 s heartbeats) and the
# router's retry, with room for a loaded 2-core box.
FAILURE_BOUND_S = 60.0


@pytest.mark.slow
def test_sigkill_decode_during_transfers(tmp_path) -> None:
    with cluster(tmp_path) as c:
        load = Load(c.url, n=6)
        wait_in_flight(c)
        c.decode.kill()
        results = load.results(FAILURE_BOUND_S)
        assert assert_clear_outcomes(results) >= 1, "killing decode mid-transfer failed nothing"
        # The surviving prefill worker lets go of every room and page (heartbeats / WRITE
        # errors fail the dead peer's rooms; nothing waits for an ack that cannot come).
        c.wait_idle(30.0, c.prefill)
        assert c.prefill.alive and c.router.alive
        c.restart(c.decode)
        assert_recovered(c)


@pytest.mark.slow
def test_sigkill_prefill_during_transfers(tmp_path) -> None:
    with cluster(tmp_path) as c:
        load = Load(c.url, n=6)
        wait_in_flight(c)
        c.prefill.kill()
        results = load.results(FAILURE_BOUND_S)
        assert assert_clear_outcomes(results) >= 1, "killing prefill mid-transfer failed nothing"
        # The surviving decode worker fails the rooms, quarantines then frees their pages.
        c.wait_idle(30.0, c.decode)
        assert c.decode.alive and c.router.alive
        c.restart(c.prefill)
        assert_recovered(c)
