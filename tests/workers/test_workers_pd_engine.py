"""PD in one process (real workers, real model, loopback transport): parity, abort, deadlines."""

from __future__ import annotations

import random

import anyio
import pytest

from pdengine.config import Deadlines, SchedulerConfig
from pdengine.engine import Engine
from pdengine.fsm import ReleasePages, RoomState
from pdengine.transport import FaultConfig
from pdengine.types import RequestFailedError, SamplingParams
from pdengine.workers import DecodeWorker, PrefillWorker

CONFIG = SchedulerConfig(chunk_tokens=32, num_pages=256, page_size=16)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n: int, base: int = 40, step: int = 23) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(base + step * i)] for i in range(n)]


def _assert_idle(stats: dict) -> None:
    for side in ("prefill", "decode"):
        s = stats[side]
        assert s["kv_pages_used"] == 0, (side, s)
        assert s["rooms_live"] == 0, (side, s)
        assert s["num_running_reqs"] == 0 and s["num_queue_reqs"] == 0, (side, s)
        assert s["oldest_nonterminal_room_age_seconds"] == 0.0, (side, s)
    assert stats["prefill"]["num_prefill_bootstrap_queue_reqs"] == 0
    assert stats["prefill"]["num_prefill_inflight_queue_reqs"] == 0
    assert stats["decode"]["num_decode_prealloc_queue_reqs"] == 0
    assert stats["decode"]["num_decode_transfer_queue_reqs"] == 0


async def _gather(engine, prompts: list[list[int]], params: SamplingParams) -> list:
    outs: list = [None] * len(prompts)

    async def one(i: int) -> None:
        outs[i] = await engine.generate(prompt_token_ids=prompts[i], params=params)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return outs


async def test_pd_greedy_equals_colocated_for_concurrent_chunked_prompts() -> None:
    prompts = _prompts(6)  # 40..155 tokens: 2..5 chunks of 32
    async with Engine("tiny", scheduler_config=CONFIG) as colocated:
        expected = await _gather(colocated, prompts, GREEDY)
    async with Engine("tiny", mode="pd", scheduler_config=CONFIG) as pd:
        got = await _gather(pd, prompts, GREEDY)
        stats = pd.stats()
        sample = {"role": "decode"}
        decode_metrics = pd.decode.metrics.registry.get_sample_value
        assert decode_metrics("pdengine_time_to_first_token_seconds_count", sample) == 6
        assert decode_metrics("pdengine_inter_token_latency_seconds_count", sample) == 6 * 11
        assert decode_metrics("pdengine_e2e_request_latency_seconds_count", sample) == 6
        assert pd.prefill.metrics.registry.get_sample_value(
            "pdengine_kv_transfer_latency_ms_count", {"role": "prefill"}) == 6
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.text == want.text
        assert have.finish_reason == "length"
    assert stats["prefill"]["succeeded"] == len(prompts)
    assert stats["prefill"]["writes"] > len(prompts)  # several chunks per room
    _assert_idle(stats)


async def test_pd_engine_over_nixl_matches_colocated() -> None:
    prompts = _prompts(2, base=70)
    async with Engine("tiny", scheduler_config=CONFIG) as colocated:
        expected = await _gather(colocated, prompts, GREEDY)
    async with Engine("tiny", mode="pd", transport="nixl", scheduler_config=CONFIG) as pd:
        got = await _gather(pd, prompts, GREEDY)
        assert pd.prefill.transport.stats["writes_done"] >= 6  # 70+ tokens: 3+ chunks each
        _assert_idle(pd.stats())
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


async def _room_of(decode: DecodeWorker, state: RoomState) -> int:
    with anyio.fail_after(20):
        while True:
            rows = [r for r in decode.rooms_snapshot() if r["state"] == state.name]
            if rows:
                return rows[0]["room_id"]
            await anyio.sleep(0.0005)


async def test_abort_mid_transfer_quarantines_decode_pages_until_ack() -> None:
    config = SchedulerConfig(chunk_tokens=16, num_pages=256, page_size=16)
    async with Engine("tiny", mode="pd", scheduler_config=config) as pd:
        released: list[str] = []
        pd.decode.actor.on(ReleasePages, lambda e: released.append(e.reason))
        prompt = _prompts(1, base=900)[0]  # ~56 chunks: the abort lands mid-transfer
        stream = pd.stream(prompt_token_ids=prompt, params=GREEDY, request_id="victim")
        room_id = await _room_of(pd.decode, RoomState.TRANSFERRING)
        assert pd.abort("victim")
        deltas = [d async for d in stream]
        assert deltas[-1].finish_reason == "abort"
        with anyio.fail_after(5):
            while pd.stats()["decode"]["kv_pages_used"] or pd.stats()["prefill"]["kv_pages_used"]:
                await anyio.sleep(0.01)
        assert pd.decode.actor.result(room_id).state is RoomState.FAILED
        assert pd.prefill.actor.result(room_id).state is RoomState.FAILED
        assert pd.decode.actor.counters.pages_quarantined > 0
        assert released == ["abort acked"]  # freed by the prefill's ack, not the drain deadline
        assert pd.prefill.transport.stats["abort_acks_sent"] >= 1
        # the engine keeps serving after an abort
        out = await pd.generate(prompt_token_ids=prompt[:50], params=GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens
        _assert_idle(pd.stats())


async def test_bootstrap_deadline_fails_a_room_the_decode_side_never_claims() -> None:
    deadlines = Deadlines(bootstrap_s=0.3, waiting_for_input_s=5, transfer_progress_s=5)
    prefill = PrefillWorker.create("tiny", "loopback", scheduler=CONFIG, deadlines=deadlines)
    async with anyio.create_task_group() as tg:
        await tg.start(prefill.run)
        with anyio.fail_after(5), pytest.raises(RequestFailedError, match="BOOTSTRAPPING"):
            await prefill.prefill(11, _prompts(1)[0], GREEDY)
        assert prefill.actor.result(11).state is RoomState.FAILED
        assert prefill.actor.counters.timeouts == 1
        stats = prefill.stats()
        assert stats["kv_pages_used"] == 0 and stats["rooms_live"] == 0 and stats["jobs"] == 0
        assert prefill.metrics.registry.get_sample_value(
            "pdengine_room_timeouts_total", {"role": "prefill"}) == 1
        assert prefill.metrics.registry.get_sample_value(
            "pdengine_num_bootstrap_failed_reqs_total", {"role": "prefill"}) == 1
        tg.cancel_scope.cancel()


async def test_waiting_for_input_deadline_fails_decode_and_frees_its_pages() -> None:
    """Decode registered and sent its pages, but the prefill half never arrives."""
    deadlines = Deadlines(bootstrap_s=5, waiting_for_input_s=0.3, transfer_progress_s=5)
    kw = {"scheduler": CONFIG, "deadlines": deadlines}
    prefill = PrefillWorker.create("tiny", "loopback", **kw)
    decode = DecodeWorker.create("tiny", "loopback", loaded=(prefill.model, prefill.tokenizer),
                                 **kw)
    decode.connect_local("inproc://p", prefill)
    async with anyio.create_task_group() as tg:
        await tg.start(prefill.run)
        await tg.start(decode.run)
        stream = decode.stream(5, _prompts(1)[0], GREEDY, "inproc://p")
        with anyio.fail_after(5), pytest.raises(RequestFailedError, match="WAITING_FOR_INPUT"):
            async for _ in stream:
                pass
        with anyio.fail_after(5):
            while decode.stats()["kv_pages_used"] or prefill.stats()["early_destinations"]:
                await anyio.sleep(0.01)
        assert decode.actor.result(5).state is RoomState.FAILED
        assert decode.stats()["rooms_live"] == 0
        # the router's prefill call, arriving late, fails at once instead of waiting to bootstrap
        with anyio.fail_after(1), pytest.raises(RequestFailedError, match="aborted by decode"):
            await prefill.prefill(5, _prompts(1)[0], GREEDY)
        assert prefill.stats()["rooms_live"] == 0 and prefill.stats()["kv_pages_used"] == 0
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("faults", "reason", "decode_counter"),
    [({"decode_faults": FaultConfig(corrupt=1.0)}, "checksum mismatch",
      "pdengine_checksum_failures_total"),
     ({"prefill_faults": FaultConfig(fail_write=1.0)}, "WRITE",
      "pdengine_num_transfer_failed_reqs_total")],
)
async def test_a_broken_transfer_fails_the_request_clearly_and_frees_both_sides(
    faults: dict, reason: str, decode_counter: str
) -> None:
    async with Engine("tiny", mode="pd", scheduler_config=CONFIG, **faults) as pd:
        with anyio.fail_after(10), pytest.raises(RequestFailedError, match=reason):
            await pd.generate(prompt_token_ids=_prompts(1, base=100)[0], params=GREEDY)
        with anyio.fail_after(5):
            while pd.stats()["pages_used"]:  # decode pages: quarantined until the ack
                await anyio.sleep(0.01)
        assert pd.decode.metrics.registry.get_sample_value(decode_counter, {"role": "decode"}) == 1
        _assert_idle(pd.stats())


async def test_decode_arriving_after_the_prefill_room_timed_out_fails_at_once() -> None:
    prefill = PrefillWorker.create("tiny", "loopback", scheduler=CONFIG, deadlines=Deadlines(
        bootstrap_s=0.2, waiting_for_input_s=30, transfer_progress_s=30))
    decode = DecodeWorker.create("tiny", "loopback", scheduler=CONFIG, deadlines=Deadlines(
        bootstrap_s=30, waiting_for_input_s=30, transfer_progress_s=30, drain_s=30),
        loaded=(prefill.model, prefill.tokenizer))
    decode.connect_local("inproc://p", prefill)
    prompt = _prompts(1)[0]
    async with anyio.create_task_group() as tg:
        await tg.start(prefill.run)
        await tg.start(decode.run)
        with pytest.raises(RequestFailedError, match="BOOTSTRAPPING"):
            await prefill.prefill(21, prompt, GREEDY)
        with anyio.fail_after(3), pytest.raises(RequestFailedError, match="already ended"):
            async for _ in decode.stream(21, prompt, GREEDY, "inproc://p"):
                pass
        with anyio.fail_after(3):  # prefill acks the ABORT at once: no 30 s drain wait
            while decode.stats()["kv_pages_used"]:
                await anyio.sleep(0.01)
        assert decode.actor.result(21).state is RoomState.FAILED
        tg.cancel_scope.cancel()


async def test_an_abort_storm_in_every_phase_leaves_nothing_behind() -> None:
    """Requests cut at random points (pages, bootstrap, transfer, decode) all end; I4 holds."""
    config = SchedulerConfig(chunk_tokens=32, num_pages=96, page_size=16)  # some wait for pages
    rng = random.Random(11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with Engine("tiny", mode="pd", scheduler_config=config) as pd:
        ends: list[str] = []

        async def cut(i: int) -> None:
            prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(20, 400))]
            stream = pd.stream(prompt_token_ids=prompt, params=params, request_id=f"r{i}")
            delay = rng.choice([0.0, 0.001, 0.01, 0.05, 0.2])
            with anyio.move_on_after(delay):
                async for _ in stream:
                    pass
            await stream.aclose()  # aborts unless the request already finished
            ends.append(f"r{i}")

        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(cut, i)
        with anyio.fail_after(5):
            while pd.stats()["pages_used"] or pd.stats()["decode"]["rooms_live"]:
                await anyio.sleep(0.01)
        assert len(ends) == 24
        _assert_idle(pd.stats())
        for side in (pd.prefill, pd.decode):
            counters = side.actor.counters
            assert counters.created == counters.removed  # every room ended and left the table
        out = await pd.generate(prompt_token_ids=[5] * 50, params=GREEDY)  # still serving
        assert len(out.token_ids) == GREEDY.max_tokens


async def test_a_decode_abort_before_its_room_exists_still_reaches_prefill() -> None:
    """Decode is waiting for pages (no room yet) when its client leaves: the prefill room,
    already waiting for bootstrap, fails at once through the ABORT notification (I6)."""
    deadlines = Deadlines(bootstrap_s=30, waiting_for_input_s=30, transfer_progress_s=30)
    kw = {"scheduler": CONFIG, "deadlines": deadlines}
    prefill = PrefillWorker.create("tiny", "loopback", **kw)
    decode = DecodeWorker.create("tiny", "loopback", loaded=(prefill.model, prefill.tokenizer),
                                 **kw)
    decode.connect_local("inproc://p", prefill)
    prompt = _prompts(1)[0]
    async with anyio.create_task_group() as tg:
        await tg.start(prefill.run)
        await tg.start(decode.run)
        tg.start_soon(prefill.prefill, 40, prompt, GREEDY)  # registers the peers
        async for _ in decode.stream(40, prompt, GREEDY, "inproc://p"):
            pass
        hog = decode.pool.allocator.alloc(decode.pool.allocator.num_free)  # pool exhausted
        stream = decode.stream(41, prompt, GREEDY, "inproc://p")
        failed: list[BaseException] = []

        async def prefill_41() -> None:
            try:
                await prefill.prefill(41, prompt, GREEDY)
            except RequestFailedError as exc:
                failed.append(exc)

        tg.start_soon(prefill_41)
        with anyio.fail_after(5):
            while prefill.room_state(41) is not RoomState.BOOTSTRAPPING:
                await anyio.sleep(0.005)
        assert decode.stats()["num_decode_prealloc_queue_reqs"] == 1
        await stream.aclose()
        with anyio.fail_after(3):
            while not failed:
                await anyio.sleep(0.01)
        assert "abort" in str(failed[0])
        decode.pool.allocator.free(hog)
        assert prefill.stats()["kv_pages_used"] == 0 and prefill.stats()["rooms_live"] == 0
        assert decode.stats()["kv_pages_used"] == 0 and decode.stats()["requests_in_flight"] == 0
        tg.cancel_scope.cancel()


async def test_seeded_sampling_through_pd_equals_colocated() -> None:
    """The prefill side's seeded draw travels with the aux record, so decode continues the
    same random stream (and logprobs of the first token come along too)."""
    prompts = _prompts(3, base=50)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=100 + i, logprobs=2,
                             ignore_eos=True) for i in range(3)]

    async def run(engine) -> list:
        return [await engine.generate(prompt_token_ids=p, params=sp)
                for p, sp in zip(prompts, params, strict=True)]

    async with Engine("tiny", scheduler_config=CONFIG) as colocated:
        expected = await run(colocated)
    async with Engine("tiny", mode="pd", scheduler_config=CONFIG) as pd:
        got = await run(pd)
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.logprobs is not None and len(have.logprobs) == len(want.logprobs)
        assert have.logprobs[0] == pytest.approx(want.logprobs[0])


async def test_a_prefill_caller_gets_an_error_not_a_hang_when_the_worker_stops() -> None:
    prefill = PrefillWorker.create("tiny", "loopback", scheduler=CONFIG)
    errors: list[BaseException] = []

    async def caller() -> None:
        try:
            await prefill.prefill(8, _prompts(1)[0], GREEDY)
        except RequestFailedError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as outer, anyio.create_task_group() as worker:
        await worker.start(prefill.run)
        outer.start_soon(caller)
        with anyio.fail_after(5):
            while prefill.room_state(8) is not RoomState.BOOTSTRAPPING:
                await anyio.sleep(0.005)
        worker.cancel_scope.cancel()  # the worker stops with the room still bootstrapping
    assert len(errors) == 1 and "stopped" in str(errors[0])
