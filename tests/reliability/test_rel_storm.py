"""Abort storm in CI (issue 8): 3 rounds x 50 streaming requests with multi-chunk prompts
(300 tokens: two prefill chunks, two WRITEs), each cut off at a random point, against the
shared deployment (three real processes, default deadlines). After every round: 0 pins,
0 leaked pages, every gauge idle within 2 s of the last abort."""

from __future__ import annotations

import anyio
import pytest
from rel_cluster import Cluster

from pdengine.server.diagnostics_storm import StormConfig, run_storm

pytestmark = pytest.mark.timeout(600)

IDLE_WITHIN_S = 2.0


def test_abort_storm_leaves_nothing_behind(pd: Cluster) -> None:
    cfg = StormConfig(url=pd.url, requests=50, rounds=3, prompt_tokens=300, max_tokens=8,
                      seed=8, drain_timeout_s=30.0)
    result = anyio.run(run_storm, cfg, False)
    assert (result.rounds, result.requests) == (3, 150)
    assert result.aborted >= 50, result  # most streams were really cut off
    assert result.pins == 0 and result.leaked_pages == 0, (result, pd.logs())
    assert result.drain_seconds_max <= IDLE_WITHIN_S, result
    assert pd.busy() == {} and pd.live_rooms() == []
    assert pd.prefill.alive and pd.decode.alive and pd.router.alive
