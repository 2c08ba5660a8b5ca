"""Scheduler planning without a model: chunking, admission, preemption, refusal, PD entry points."""

from __future__ import annotations

import pytest

from pdengine.cache import PageAllocator, PageAllocatorError
from pdengine.config import SchedulerConfig
from pdengine.runtime import Scheduler, SeqStatus, Sequence
from pdengine.types import InvalidRequestError, PromptTooLongError, SamplingParams

TOKEN = 7  # what the fake model samples: never an eos


def make(cfg: SchedulerConfig, **kw) -> Scheduler:
    return Scheduler(cfg, PageAllocator(cfg.num_pages), eos_token_ids=[99], **kw)


def seq(rid: str, n: int, max_tokens: int = 4, **kw) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def run_step(s: Scheduler, token: int = TOKEN):
    step = s.schedule()
    assert step is not None
    return step, s.update(step, [token] * len(step.items))


def test_long_prompt_is_prefilled_in_chunks_then_decoded():
    s = make(SchedulerConfig(page_size=4, num_pages=16, chunk_tokens=5))
    a = seq("a", 12, max_tokens=2)
    s.add(a)
    sizes = []
    while a.status is not SeqStatus.DECODING:
        step, out = run_step(s)
        sizes.append(step.items[0].num_tokens)
    assert sizes == [5, 5, 2]
    assert a.output_token_ids == [TOKEN]  # sampled only after the last chunk
    step, out = run_step(s)
    assert step.is_decode and step.items[0].start == 12
    assert out.finished == [a] and a.finish_reason == "length"
    assert s.allocator.num_used == 0


def test_decodes_and_prefill_chunks_share_a_step():
    s = make(SchedulerConfig(page_size=4, num_pages=32, chunk_tokens=6))
    s.add(seq("a", 3, max_tokens=8))
    run_step(s)
    s.add(seq("b", 20))
    step, _ = run_step(s)
    assert [(it.seq.request_id, it.num_tokens) for it in step.items] == [("a", 1), ("b", 6)]
    assert not step.is_decode


def test_admission_waits_for_free_pages_in_arrival_order():
    s = make(SchedulerConfig(page_size=4, num_pages=4, chunk_tokens=64))
    s.add(seq("a", 12, max_tokens=4))  # 3 pages
    s.add(seq("b", 8, max_tokens=1))  # 2 pages: must wait
    s.add(seq("c", 2, max_tokens=1))  # would fit, but may not overtake b
    step, _ = run_step(s)
    assert [it.seq.request_id for it in step.items] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b", "c"]


def test_preemption_frees_the_newest_and_recomputes_it():
    s = make(SchedulerConfig(page_size=2, num_pages=4, chunk_tokens=64))
    a, b = seq("a", 4, max_tokens=3), seq("b", 3, max_tokens=3)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: a 2 pages, b 2 pages, pool full
    assert s.allocator.num_free == 0
    step, _ = run_step(s)  # a needs a 3rd page: b (newest) is preempted
    assert [it.seq.request_id for it in step.items] == ["a"]
    assert b.status is SeqStatus.WAITING and b.num_preemptions == 1 and b.page_table is None
    known = list(b.token_ids)
    while not a.is_finished:
        run_step(s)
    step, _ = run_step(s)  # b comes back and recomputes prompt + its first output
    assert step.items[0].seq is b and step.items[0].num_tokens == len(known)
    while s.has_work():
        run_step(s)
    assert b.output_token_ids == [TOKEN] * 3 and s.allocator.num_used == 0
    assert s.stats()["preemptions"] == 1


def test_a_request_that_can_never_fit_is_refused():
    s = make(SchedulerConfig(page_size=4, num_pages=4, max_model_len=64))
    with pytest.raises(PromptTooLongError):
        s.add(seq("a", 17))  # pool holds 16 tokens
    with pytest.raises(InvalidRequestError) as err:
        s.add(seq("b", 10, max_tokens=7))
    assert err.value.field == "max_tokens"
    s2 = make(SchedulerConfig(page_size=4, num_pages=64, max_model_len=20))
    with pytest.raises(PromptTooLongError):
        s2.add(seq("c", 21))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        s2.add(seq("d", 18, max_tokens=3))
    assert not s.has_work() and not s2.has_work()


def test_stop_token_ids_and_eos_finish_unless_ignored():
    s = make(SchedulerConfig(page_size=4, num_pages=8))
    a = seq("a", 3, max_tokens=10, stop_token_ids=(42,))
    b = seq("b", 3, max_tokens=2, ignore_eos=True)
    c = seq("c", 3, max_tokens=10)
    for q in (a, b, c):
        s.add(q)
    step = s.schedule()
    s.update(step, [42, 99, 99])
    assert (a.finish_reason, b.finish_reason, c.finish_reason) == ("stop", None, "stop")
    assert a.output_token_ids == [42] and c.output_token_ids == [99]


def test_prefill_only_reports_completed_pages_per_chunk_and_hands_pages_over():
    s = make(SchedulerConfig(page_size=4, num_pages=8, chunk_tokens=6), prefill_only=True)
    a = seq("a", 14)
    s.add(a)
    reported: list[int] = []
    lasts = []
    while a.status is not SeqStatus.PREFILLED:
        _, out = run_step(s)
        for chunk in out.chunks:
            reported += chunk.page_indices
            lasts.append(chunk.is_last)
            assert chunk.pages == [a.page_table.pages[i] for i in chunk.page_indices]
    assert reported == [0, 1, 2, 3]  # chunks end at 6, 12, 14: pages 0 | 1,2 | 3 (partial, last)
    assert lasts == [False, False, True]
    assert out.prefilled == [a] and a.output_token_ids == [TOKEN]
    assert not s.has_work() and s.allocator.num_used == 4  # the caller owns them now
    s.release(a)
    assert s.allocator.num_used == 0


def test_add_prefilled_decodes_from_pages_it_is_given():
    cfg = SchedulerConfig(page_size=4, num_pages=8)
    s = make(cfg)
    pages = s.allocator.alloc(2)
    a = seq("a", 6, max_tokens=3)
    out = s.add_prefilled(a, pages, first_token=11)
    assert out.sampled == [(a, 11)] and not out.finished
    step, _ = run_step(s)
    assert step.is_decode and step.items[0].start == 6 and a.page_table.pages == pages
    run_step(s)
    assert a.finish_reason == "length" and s.allocator.num_used == 0
    b = seq("b", 3, max_tokens=1)
    out = s.add_prefilled(b, s.allocator.alloc(1), first_token=11)
    assert out.finished == [b] and s.allocator.num_used == 0


def test_abort_frees_pages_wherever_the_sequence_is():
    s = make(SchedulerConfig(page_size=4, num_pages=8, chunk_tokens=4))
    a, b = seq("a", 10), seq("b", 3)
    s.add(a)
    run_step(s)  # a is mid-prefill
    s.add(b)
    s.abort(a)
    s.abort(b)  # still waiting
    assert not s.has_work() and s.allocator.num_used == 0
    assert a.finish_reason == b.finish_reason == "abort"


def test_allocator_refuses_what_it_cannot_give_and_catches_double_free():
    alloc = PageAllocator(3)
    pages = alloc.alloc(2)
    assert alloc.alloc(2) is None and alloc.num_used == 2
    alloc.incref(pages[:1])
    alloc.free(pages)
    assert alloc.num_used == 1 and alloc.refcount(pages[0]) == 1
    alloc.free(pages[:1])
    with pytest.raises(PageAllocatorError):
        alloc.free(pages[:1])
    alloc.check_invariants()
    assert alloc.num_free == 3 and alloc.high_water == 2
