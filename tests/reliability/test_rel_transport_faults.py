"""Transport faults in real worker processes, injected by the fault transport
(`PDENGINE_FAULTS`, pdengine/transport/faults.py) with small deadlines (`PDENGINE_DEADLINES`).

- a stalled WRITE: the room's transfer-progress deadline fires, the request fails clearly;
- lost, duplicated, delayed and reordered notifications: every request ends (success or a
  clear error), no successful request carries wrong tokens, nothing stays live;
- a corrupted chunk: the checksum catches it, the room fails, the client gets an error.

Then the faulty role is restarted without faults and new requests succeed.
"""

from __future__ import annotations

import pytest
from rel_checks import Load, assert_clear_outcomes, assert_recovered
from rel_cluster import QUARANTINE_BOUND_S, cluster, prompt_of, stream_completion

pytestmark = pytest.mark.timeout(420)

FAILURE_BOUND_S = 60.0


def _without_faults(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PDENGINE_FAULTS"}


def test_corrupted_chunk_fails_the_room_cleanly(tmp_path) -> None:
    # The receiving side flips a byte of every arriving chunk before it is verified.
    with cluster(tmp_path, decode_env={"PDENGINE_FAULTS": "corrupt=1.0"}) as c:
        results = Load(c.url, n=3).results(FAILURE_BOUND_S)
        assert assert_clear_outcomes(results) == 3, "a corrupted transfer produced output"
        assert c.counter(c.decode, "checksum_failures_total") >= 1
        assert any("checksum" in str(r.error).lower() for r in results), results
        c.wait_idle(QUARANTINE_BOUND_S)
        c.decode.env = _without_faults(c.decode.env)
        c.restart(c.decode)
        assert_recovered(c)


@pytest.mark.slow
def test_stalled_transfer_hits_the_progress_deadline(tmp_path) -> None:
    # Every WRITE stalls on the sender; the transport's own WRITE deadline is far away, so it is
    # the room's transfer-progress deadline (3 s) that must end it.
    deadlines = ("bootstrap_s=5,waiting_for_input_s=5,transfer_progress_s=3,transfer_total_s=8,"
                 "drain_s=2,write_s=600")
    env = {"PDENGINE_FAULTS": "stall_write=1.0", "PDENGINE_DEADLINES": deadlines}
    with cluster(tmp_path, prefill_env=env) as c:
        results = Load(c.url, n=3).results(FAILURE_BOUND_S)
        assert assert_clear_outcomes(results) == 3, "a request got through a stalled transfer"
        assert c.counter(c.prefill, "room_timeouts_total") >= 1
        c.wait_idle(QUARANTINE_BOUND_S)
        c.prefill.env = _without_faults(c.prefill.env)
        c.restart(c.prefill)
        assert_recovered(c)


@pytest.mark.slow
def test_lost_duplicated_reordered_notifications(tmp_path) -> None:
    faults = {"PDENGINE_FAULTS": "drop=0.1,duplicate=0.3,delay=0.3,reorder=0.5"}
    prompts = [prompt_of(900, salt) for salt in range(8)]
    with cluster(tmp_path, worker_env=faults) as c:
        faulty = [stream_completion(c.url, p, 6, timeout_s=FAILURE_BOUND_S) for p in prompts]
        assert_clear_outcomes(faulty)
        c.wait_idle(QUARANTINE_BOUND_S)
        for role in (c.prefill, c.decode):
            role.env = _without_faults(role.env)
            c.restart(role)
        clean = [stream_completion(c.url, p, 6) for p in prompts]
        assert all(r.ok for r in clean), clean
        # Whatever got through the faults is exactly what a clean deployment answers.
        for got, want in zip(faulty, clean, strict=True):
            if got.ok:
                assert got.text == want.text
        assert_recovered(c)
