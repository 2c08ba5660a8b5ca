"""Protocol tests through the in-process back-ends (loopback, and loopback under the
fault wrapper with every fault off): same transport, same checksums, same messages."""

from __future__ import annotations

import random

import pytest
import torch

from pdengine.config import KVLayout
from pdengine.fsm.events import Abort, AbortAcked, ChunkDone, PeerFailed, TransferFailed
from pdengine.transport import (
    AuxRecord,
    FaultConfig,
    FaultyBackend,
    KVTransport,
    Transport,
    TransportBackend,
)
from pdengine.transport.loopback import LoopbackBackend, LoopbackHub

LAYOUT = KVLayout(num_pages=32, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8,
                  dtype="float16")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pair(kind: str, *, sender_faults: FaultConfig | None = None,
              receiver_faults: FaultConfig | None = None, clock=None, checksums=True):
    hub = LoopbackHub()
    backends = []
    for name, faults in (("pre", sender_faults), ("dec", receiver_faults)):
        backend = LoopbackBackend(name, hub)
        if kind == "faulty" or faults is not None:
            backend = FaultyBackend(backend, faults or FaultConfig(), random.Random(7))
        backends.append(backend)
    kwargs = {"checksums": checksums, "write_deadline_s": 5.0}
    if clock is not None:
        kwargs["clock"] = clock
    prefill = KVTransport(backends[0], "prefill", **kwargs)
    decode = KVTransport(backends[1], "decode", **kwargs)
    src = torch.randn(LAYOUT.shape).to(torch.float16)
    dst = torch.zeros(LAYOUT.shape, dtype=torch.float16)
    prefill.register(src)
    decode.register(dst)
    assert prefill.add_peer(decode.agent_metadata()) == "dec"
    assert decode.add_peer(prefill.agent_metadata()) == "pre"
    return prefill, decode, src, dst


BACKENDS = ["loopback", "faulty"]


@pytest.mark.parametrize("kind", BACKENDS)
def test_multi_chunk_room_arrives_verified_byte_for_byte(kind):
    prefill, decode, src, dst = make_pair(kind)
    src_pages, dst_pages = [3, 4, 5, 6, 10, 11], [20, 21, 22, 7, 8, 9]
    chunks = [(src_pages[:2], dst_pages[:2]), (src_pages[2:4], dst_pages[2:4]),
              (src_pages[4:], dst_pages[4:])]
    sums = []
    for i, (s, d) in enumerate(chunks):
        last = i == len(chunks) - 1
        aux = AuxRecord(first_token=42, prompt_len=23, chunk_checksums=tuple(sums)) if last else None
        sums.append(prefill.write_pages("dec", 9, i, last, s, d, aux=aux))
    sent = prefill.poll()
    assert [(e.room_id, e.chunk, e.is_last) for e in sent] == [(9, 0, False), (9, 1, False),
                                                               (9, 2, True)]
    assert all(isinstance(e, ChunkDone) and e.nbytes == 2 * LAYOUT.page_nbytes for e in sent)
    got = decode.drain_notifications()
    assert [type(e) for e in got] == [ChunkDone] * 3
    assert all(e.checksum_ok for e in got)
    assert got[-1].is_last and got[-1].aux == {"first_token": 42, "prompt_len": 23,
                                               "chunk_checksums": sums[:2], "extra": {}}
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert torch.equal(src[s].view(torch.uint8), dst[d].view(torch.uint8))
    assert prefill.inflight(9) == 0


@pytest.mark.parametrize("kind", BACKENDS)
def test_interleaved_rooms_keep_their_own_chunks(kind):
    prefill, decode, src, dst = make_pair(kind)
    plan = {room: ([room, room + 8], [room + 16, room + 24]) for room in range(4)}
    for chunk in range(2):
        for room, (s, d) in plan.items():
            prefill.write_pages("dec", room, chunk, chunk == 1, [s[chunk]], [d[chunk]])
    prefill.poll()
    got = decode.drain_notifications()
    assert sorted((e.room_id, e.chunk) for e in got) == [(r, c) for r in range(4) for c in (0, 1)]
    for s, d in plan.values():
        for sp, dp in zip(s, d, strict=True):
            assert torch.equal(src[sp], dst[dp])


def test_corrupted_bytes_fail_the_room_with_a_clear_reason():
    prefill, decode, _, _ = make_pair("faulty", receiver_faults=FaultConfig(corrupt=1.0))
    expected = prefill.write_pages("dec", 5, 0, True, [1, 2], [3, 4])
    prefill.poll()
    (event,) = decode.drain_notifications()
    assert isinstance(event, TransferFailed) and event.room_id == 5
    assert "checksum mismatch in room 5 chunk 0" in event.reason
    assert f"expected {expected:016x}" in event.reason
    assert decode.backend.injected["corrupt"] == 1


def test_checksums_off_lets_corruption_through_and_reports_zero():
    prefill, decode, _, _ = make_pair("faulty", receiver_faults=FaultConfig(corrupt=1.0),
                                      checksums=False)
    assert prefill.write_pages("dec", 5, 0, True, [1], [3]) == 0
    prefill.poll()
    (event,) = decode.drain_notifications()
    assert isinstance(event, ChunkDone) and event.is_last


def test_abort_ack_only_after_the_inflight_write_drains():
    clock = FakeClock()
    prefill, decode, _, _ = make_pair("faulty", sender_faults=FaultConfig(stall_write=1.0),
                                      clock=clock)
    prefill.write_pages("dec", 1, 0, True, [0], [0])  # stalls: stays in flight
    assert prefill.inflight(1) == 1
    decode.abort("pre", 1, "client went away")
    got = prefill.drain_notifications()
    assert got == [Abort(1, reason="client went away", from_peer=True)]
    assert prefill.write_pages("dec", 1, 1, True, [1], [1]) is None  # fenced
    assert prefill.poll() == []
    assert decode.drain_notifications() == []  # no ack while the WRITE is in flight
    clock.now = 6.0  # past the write deadline: the stalled WRITE fails, drain is over
    failed = prefill.poll()
    assert [type(e) for e in failed] == [TransferFailed] and "no completion" in failed[0].reason
    assert prefill.inflight(1) == 0
    assert decode.drain_notifications() == [AbortAcked(1)]


@pytest.mark.parametrize("kind", BACKENDS)
def test_prefill_side_abort_reaches_decode_then_acks(kind):
    prefill, decode, _, _ = make_pair(kind)
    prefill.write_pages("dec", 2, 0, False, [0], [0])
    prefill.abort("dec", 2, "prefill forward failed")
    assert prefill.inflight(2) == 1
    events = decode.drain_notifications()
    assert events[0] == ChunkDone(2, 0, nbytes=LAYOUT.page_nbytes)
    assert events[1] == Abort(2, reason="prefill forward failed", from_peer=True)
    assert len(events) == 2
    prefill.poll()
    assert decode.drain_notifications() == [AbortAcked(2)]


def test_fail_notification_becomes_transfer_failed_on_the_peer():
    prefill, decode, _, _ = make_pair("loopback")
    decode.fail("pre", 4, "decode out of pages")
    (event,) = prefill.drain_notifications()
    assert isinstance(event, TransferFailed) and "decode out of pages" in event.reason
    assert decode.drain_notifications() == [AbortAcked(4)]


def test_failed_write_and_dead_peer_become_events():
    prefill, decode, _, _ = make_pair("faulty", sender_faults=FaultConfig(fail_write=1.0))
    prefill.write_pages("dec", 3, 0, True, [0], [0])
    (event,) = prefill.poll()
    assert isinstance(event, TransferFailed) and "injected fault" in event.reason
    decode.close()
    prefill.backend.config = FaultConfig()
    prefill.write_pages("dec", 6, 0, True, [0], [0])
    events = prefill.poll()
    assert isinstance(events[0], TransferFailed) and events[0].room_id == 6
    prefill.abort("dec", 7)
    assert [type(e) for e in prefill.poll()] == [PeerFailed]


def test_duplicated_delayed_reordered_notifications_deliver_each_chunk_once():
    config = FaultConfig(duplicate=0.5, delay=0.5, max_delay_polls=3, reorder=0.5)
    prefill, decode, _, _ = make_pair("faulty", receiver_faults=config)
    for room in range(8):
        prefill.write_pages("dec", room, 0, True, [room], [room])
    prefill.poll()
    got = []
    for _ in range(5):
        got += decode.drain_notifications()
    assert sorted(e.room_id for e in got) == list(range(8))
    injected = decode.backend.injected
    assert injected["duplicate"] + injected["delay"] + injected["reorder"] > 0


def test_dropped_notifications_never_arrive():
    prefill, decode, _, _ = make_pair("faulty", receiver_faults=FaultConfig(drop=1.0))
    prefill.write_pages("dec", 1, 0, True, [0], [0])
    prefill.poll()
    assert decode.drain_notifications() == []


def test_bad_page_lists_raise_value_errors():
    prefill, _, _, _ = make_pair("loopback")
    with pytest.raises(ValueError, match="src_pages has 2 pages but dst_pages has 1"):
        prefill.write_pages("dec", 1, 0, True, [0, 1], [0])
    with pytest.raises(ValueError, match="outside a pool of 32"):
        prefill.write_pages("dec", 1, 0, True, [40], [0])


def test_fault_config_rejects_bad_probabilities():
    with pytest.raises(ValueError, match="drop must be a probability"):
        FaultConfig(drop=1.5)


def test_implementations_satisfy_the_protocols():
    prefill, decode, _, _ = make_pair("faulty")
    assert isinstance(prefill, Transport) and isinstance(decode, Transport)
    assert isinstance(prefill.backend, TransportBackend)
    assert isinstance(prefill.backend.inner, TransportBackend)


def test_forget_room_lifts_the_fence_only_after_the_drain():
    clock = FakeClock()
    prefill, decode, _, _ = make_pair("faulty", sender_faults=FaultConfig(stall_write=1.0),
                                      clock=clock)
    prefill.write_pages("dec", 8, 0, False, [0], [0])
    prefill.abort("dec", 8, "deadline")
    prefill.forget_room(8)  # still in flight: the fence stays
    assert prefill.write_pages("dec", 8, 1, True, [1], [1]) is None
    clock.now = 6.0
    prefill.poll()
    assert decode.drain_notifications() == [Abort(8, reason="deadline", from_peer=True),
                                            AbortAcked(8)]
    prefill.forget_room(8)
    prefill.backend.config = FaultConfig()
    assert prefill.write_pages("dec", 8, 1, True, [1], [1]) is not None


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_last_chunk_without_pages_still_delivers_its_tag_and_aux(kind):
    prefill, decode, _, _ = make_pair(kind)
    prefill.write_pages("dec", 3, 1, True, [], [], aux=AuxRecord(first_token=5, prompt_len=16))
    assert prefill.poll() == [ChunkDone(3, 1, is_last=True)]
    (event,) = decode.drain_notifications()
    assert isinstance(event, ChunkDone) and event.is_last and event.aux["first_token"] == 5
