"""Property-based page accounting: random request mixes with aborts and preemptions under tiny pools."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdengine.cache import PageAllocator
from pdengine.config import SchedulerConfig
from pdengine.runtime import Scheduler, SeqStatus, Sequence
from pdengine.types import InvalidRequestError, SamplingParams

add_op = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12))
step_op = st.tuples(st.just("step"), st.integers(0, 3), st.just(0))  # token 3 is the eos
abort_op = st.tuples(st.just("abort"), st.integers(0, 50), st.just(0))
release_op = st.tuples(st.just("release"), st.just(0), st.just(0))  # a PD transfer completed
ops_strategy = st.lists(st.one_of(add_op, step_op, step_op, step_op, abort_op, release_op),
                        max_size=60)


def check_ownership(s: Scheduler, live: list[Sequence]) -> None:
    """Every used page belongs to exactly one live sequence; nothing else is used."""
    s.allocator.check_invariants()
    owned: list[int] = []
    for q in live:
        if q.status in (SeqStatus.PREFILLING, SeqStatus.DECODING, SeqStatus.PREFILLED):
            assert q.page_table is not None
            owned += q.page_table.pages
            assert q.page_table.capacity >= q.num_computed
        else:
            assert q.page_table is None
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert len(owned) == s.allocator.num_used
    assert all(s.allocator.refcount(p) == 1 for p in owned)


@settings(max_examples=100, deadline=None)
@given(
    ops=ops_strategy,
    num_pages=st.integers(4, 12),
    page_size=st.sampled_from([1, 2, 4]),
    chunk=st.integers(1, 16),
    prefill_only=st.booleans(),
)
def test_pages_are_never_shared_and_all_come_back(ops, num_pages, page_size, chunk, prefill_only):
    cfg = SchedulerConfig(page_size=page_size, num_pages=num_pages, chunk_tokens=chunk,
                          max_batch_size=4, max_model_len=64)
    s = Scheduler(cfg, PageAllocator(num_pages), eos_token_ids=[3], prefill_only=prefill_only)
    live: list[Sequence] = []
    handed_off: list[Sequence] = []  # prefill-only: pages owned by the caller until released
    for op, a, b in ops:
        if op == "add":
            q = Sequence(f"r{len(live)}", [5] * a, SamplingParams(max_tokens=b))
            try:
                s.add(q)
            except InvalidRequestError:
                assert a + (0 if prefill_only else b) > min(64, num_pages * page_size)
                continue
            live.append(q)
        elif op == "step" and s.has_work():
            step = s.schedule()
            if step is None:  # only possible while handed-off pages block admission
                assert handed_off
                continue
            handed_off += s.update(step, [a] * len(step.items)).prefilled
        elif op == "release" and handed_off:
            s.release(handed_off.pop(0))
        elif op == "abort" and live:
            s.abort(live[a % len(live)])
        check_ownership(s, live)
    # Drain: everything finishes (or is handed off and released) and every page is back.
    for _ in range(10_000):
        if not s.has_work():
            break
        step = s.schedule()
        if step is None:
            assert handed_off, "work left but nothing schedulable"
            s.release(handed_off.pop(0))
        else:
            handed_off += s.update(step, [5] * len(step.items)).prefilled
        check_ownership(s, live)
    assert not s.has_work()
    for q in handed_off:
        s.release(q)
    assert all(q.is_finished for q in live)
    assert s.allocator.num_used == 0
    s.allocator.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=80))
def test_allocator_refcounts_against_a_model(ops):
    alloc = PageAllocator(8)
    held: list[int] = []  # one entry per reference we hold
    for take, n in ops:
        if take:
            got = alloc.alloc(n)
            if got is None:
                assert n > alloc.num_free
            else:
                assert not set(got) & set(held)
                held += got
        elif held:
            page = held[n % len(held)]
            if n % 2:
                alloc.incref([page])
                held.append(page)
            else:
                alloc.free([page])
                held.remove(page)
        alloc.check_invariants()
        assert alloc.num_used == len(set(held))
    alloc.free(held)
    assert alloc.num_used == 0 and alloc.num_free == 8
