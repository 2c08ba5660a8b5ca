"""NIXL over UCX between two real processes on 127.0.0.1 (this one and a spawned peer)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transport_peer_proc import call, start_peer

from pdengine.config import KVLayout
from pdengine.fsm.events import AbortAcked, ChunkDone, Event, PeerFailed, TransferFailed
from pdengine.transport.faults import FaultConfig, FaultyBackend
from pdengine.transport.nixl import NixlBackend
from pdengine.transport.transfer import KVTransport

LAYOUT = KVLayout(num_pages=64, num_layers=4, page_size=16, num_kv_heads=2, head_dim=64,
                  dtype="float16")  # 32 KiB pages, 2 MiB pool


def local_transport(name: str, role: str, **kwargs: Any) -> tuple[KVTransport, torch.Tensor]:
    pool = torch.zeros(LAYOUT.shape, dtype=torch.float16)
    backend = FaultyBackend(NixlBackend(name), FaultConfig(), 3)
    transport = KVTransport(backend, role, **kwargs)  # type: ignore[arg-type]
    transport.register(pool)
    return transport, pool


def collect(step: Callable[[], list[Event]], done: Callable[[list[Event]], bool],
            timeout: float = 20.0) -> list[Event]:
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while not done(events):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; events so far: {events}")
        events += step()
    return events


@pytest.fixture
def prefill_peer():
    """A prefill process pushing into this process's decode transport."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    process, conn, metadata = start_peer(f"pre-{tag}", "prefill", LAYOUT, seed=5)
    decode, pool = local_transport(f"dec-{tag}", "decode")
    peer = decode.add_peer(metadata)
    me = call(conn, "add_peer", decode.agent_metadata())
    yield conn, peer, me, decode, pool
    call(conn, "stop")
    process.join(10)
    decode.close()


def chunk_events(events: list[Event], room: int) -> list[Event]:
    return [e for e in events if e.room_id == room]  # type: ignore[union-attr]


def test_multi_chunk_and_interleaved_rooms_arrive_byte_for_byte(prefill_peer):
    conn, _peer, me, decode, pool = prefill_peer
    plan = {1: [([0, 1, 2, 3], [40, 41, 42, 43]), ([4, 5, 6, 7], [10, 11, 20, 21]),
                ([8, 9], [60, 61])]}
    for room in range(2, 6):  # interleaved: one page per chunk, two chunks each
        plan[room] = [([10 + room], [room]), ([20 + room], [30 + room])]
    plan[6] = [([], [])]  # a last chunk that completed no page: only its tag travels
    for chunk in range(3):
        for room, chunks in plan.items():
            if chunk < len(chunks):
                src, dst = chunks[chunk]
                assert call(conn, "write", me, room, chunk, chunk == len(chunks) - 1, src, dst)
    expected = sum(len(c) for c in plan.values())
    got = collect(decode.drain_notifications, lambda ev: len(ev) >= expected)
    assert all(isinstance(e, ChunkDone) and e.checksum_ok for e in got)
    for room, chunks in plan.items():
        room_events = chunk_events(got, room)
        assert sorted(e.chunk for e in room_events) == list(range(len(chunks)))
        (last,) = [e for e in room_events if e.is_last]
        assert last.aux is not None and last.aux["first_token"] == 11
        for src, dst in chunks:
            sent = call(conn, "pages", src)
            assert torch.equal(sent.view(torch.uint8), pool[dst].view(torch.uint8))
    # Runs contiguous on both sides are one descriptor: 1 + 2 + 1 for room 1, 1 per chunk after.
    assert call(conn, "descriptors") == 4 + 8
    sender = collect(lambda: call(conn, "events"), lambda ev: len(ev) >= expected)
    assert sorted((e["room_id"], e["chunk"]) for e in sender if e["type"] == "ChunkDone") == sorted(
        (room, c) for room, chunks in plan.items() for c in range(len(chunks)))


def test_corrupted_chunk_is_caught_by_the_checksum(prefill_peer):
    conn, _peer, me, decode, _pool = prefill_peer
    decode.backend.config = FaultConfig(corrupt=1.0)  # type: ignore[attr-defined]
    call(conn, "write", me, 9, 0, True, [1, 2, 3], [4, 5, 6])
    (event,) = collect(decode.drain_notifications, lambda ev: len(ev) >= 1)
    assert isinstance(event, TransferFailed) and event.room_id == 9
    assert "checksum mismatch in room 9 chunk 0" in event.reason


def test_abort_racing_the_last_chunk_is_acked_only_after_the_write_drained(prefill_peer):
    conn, peer, me, decode, pool = prefill_peer
    src, dst = list(range(0, 48)), list(range(8, 56))  # 1.5 MiB last chunk
    conn.send(("write_then_wait_for_abort", me, 7, src, dst))
    time.sleep(0.2)  # let the WRITE get posted before the abort leaves
    decode.abort(peer, 7, "client disconnected")
    events = collect(decode.drain_notifications,
                     lambda ev: any(isinstance(e, AbortAcked) for e in ev))
    # The ack means no WRITE of room 7 can land any more: the pages hold the full chunk.
    landed = pool[dst].clone()
    assert conn.poll(20)
    report = conn.recv()
    assert report == {"posted_inflight": 1, "seen_abort": True, "inflight_at_abort": 1,
                      "refused_after_abort": True, "acks_sent": 1}
    assert torch.equal(landed.view(torch.uint8), call(conn, "pages", src).view(torch.uint8))
    assert [type(e) for e in events].count(AbortAcked) == 1
    time.sleep(0.2)  # nothing more lands in the quarantined pages
    later = decode.drain_notifications()
    assert not any(isinstance(e, AbortAcked) for e in later)
    assert torch.equal(pool[dst].view(torch.uint8), landed.view(torch.uint8))


def test_write_to_a_killed_peer_ends_in_failure_events_not_a_hang():
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    process, conn, metadata = start_peer(f"dec-{tag}", "decode", LAYOUT)
    prefill, pool = local_transport(f"pre-{tag}", "prefill", write_deadline_s=5.0)
    pool.fill_(1.0)
    try:
        peer = prefill.add_peer(metadata)
        call(conn, "add_peer", prefill.agent_metadata())
        prefill.write_pages(peer, 1, 0, True, [0, 1], [0, 1])
        first = collect(prefill.poll, lambda ev: len(ev) >= 1)
        assert isinstance(first[0], ChunkDone)

        prefill.write_pages(peer, 2, 0, True, list(range(48)), list(range(48)))  # in flight
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        started = time.monotonic()
        second = collect(prefill.poll, lambda ev: prefill.inflight(2) == 0, timeout=15)
        assert all(isinstance(e, ChunkDone | TransferFailed | PeerFailed) for e in second)

        prefill.write_pages(peer, 3, 0, True, [5], [5])
        third = collect(prefill.poll,
                        lambda ev: any(isinstance(e, TransferFailed) for e in ev), timeout=15)
        failed = [e for e in third if isinstance(e, TransferFailed)]
        assert failed[0].room_id == 3 and peer in failed[0].reason
        assert time.monotonic() - started < 12  # bounded by the write deadline, not forever
        assert any(isinstance(e, PeerFailed) and e.peer == peer for e in second + third)
    finally:
        if process.is_alive():
            process.kill()
        prefill.close()
