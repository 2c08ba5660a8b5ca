"""Wire messages, run merging and descriptor pieces: pure functions."""

from __future__ import annotations

import pytest

from pdengine.transport.base import AuxRecord, MsgKind, PageRun, WireMessage, merge_runs
from pdengine.transport.nixl import run_pieces


def test_chunk_message_round_trips_with_named_fields():
    message = WireMessage(MsgKind.CHUNK, 12, chunk=3, is_last=True, checksum=2**64 - 1,
                          nbytes=4096, dst_runs=((5, 3), (40, 1)),
                          aux=AuxRecord(first_token=7, prompt_len=100, chunk_checksums=(1, 2)))
    raw = message.encode()
    assert b'"kind":"chunk"' in raw and b'"room_id":12' in raw
    decoded = WireMessage.decode(raw)
    assert decoded == message
    assert decoded.dst_pages() == [5, 6, 7, 40]


def test_control_message_is_small_and_round_trips():
    message = WireMessage(MsgKind.ABORT, 4, reason="client disconnected")
    raw = message.encode()
    assert len(raw) < 80 and b"dst_runs" not in raw
    assert WireMessage.decode(raw) == message


@pytest.mark.parametrize("raw", [b"not json", b'{"kind":"nope","room_id":1}', b'{"kind":"abort"}'])
def test_malformed_messages_raise_value_error(raw):
    with pytest.raises(ValueError, match="malformed transport notification"):
        WireMessage.decode(raw)


def test_merge_runs_needs_both_sides_contiguous():
    assert merge_runs([1, 2, 3, 7, 8], [10, 11, 5, 6, 7]) == [
        PageRun(1, 10, 2), PageRun(3, 5, 1), PageRun(7, 6, 2)]
    assert merge_runs([], []) == []


def test_run_pieces_cover_the_run_with_few_power_of_two_descriptors():
    assert run_pieces(1, 8) == [(0, 0)]
    assert run_pieces(7, 8) == [(0, 2), (4, 1), (6, 0)]
    assert run_pieces(600, 8) == [(0, 8), (256, 8), (512, 6), (576, 4), (592, 3)]
    for count in range(1, 300):
        pieces = run_pieces(count, 4)
        assert sum(1 << level for _, level in pieces) == count
        assert all(level <= 4 for _, level in pieces)
