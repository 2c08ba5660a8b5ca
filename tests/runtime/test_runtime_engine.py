"""The colocated Engine API on the built-in tiny model: sampling options, errors, aborts, leaks."""

from __future__ import annotations

import math

import anyio
import pytest

from pdengine import Engine, SamplingParams
from pdengine.config import SchedulerConfig
from pdengine.engine import ColocatedEngine
from pdengine.types import InvalidRequestError, PromptTooLongError, RequestFailedError

PROMPT = [256, 72, 101, 108, 108, 111]
SMALL = SchedulerConfig(page_size=4, num_pages=64, chunk_tokens=8, max_model_len=256)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


async def wait_idle(engine: ColocatedEngine) -> dict:
    with anyio.fail_after(5):
        while engine.stats()["requests_in_flight"] or engine.stats()["running"]:
            await anyio.sleep(0.01)
    return engine.stats()


async def test_generate_stream_and_chat(tiny_path):
    engine = Engine(model=str(tiny_path), scheduler_config=SMALL)
    assert engine.stats()["pages_used"] == 0  # before start: the gauges' idle values
    async with engine:
        out = await engine.generate(prompt_token_ids=[1, 2, 3], params=greedy(16))
        assert len(out.token_ids) == 16 and out.finish_reason == "length"
        assert out.prompt_token_ids == [1, 2, 3] and out.metrics["ttft_s"] > 0
        assert out.text == engine.tokenizer.decode(out.token_ids)
        deltas = [d async for d in engine.stream(prompt="Hello", params=greedy(8))]
        assert [d.finish_reason for d in deltas][-1] == "length"
        assert sum(len(d.token_ids) for d in deltas) == 8
        chat = await engine.chat([{"role": "user", "content": "hi"}], params=greedy(4))
        assert chat.prompt_token_ids == engine.prompt_from_messages(
            [{"role": "user", "content": "hi"}]
        )
        assert len(chat.token_ids) == 4
        assert engine.model_name == str(tiny_path) and engine.max_model_len == 256


async def test_stop_strings_cut_the_text_and_streams_agree(tiny_path):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        free = await engine.generate(prompt_token_ids=PROMPT, params=greedy(40))
        text = free.text
        k = next(i for i in range(5, len(text) - 2) if text[i : i + 2].isprintable())
        stop = text[k : k + 2]
        cut = await engine.generate(prompt_token_ids=PROMPT, params=greedy(40, stop=(stop,)))
        assert cut.finish_reason == "stop"
        assert cut.text == text[: text.find(stop)]
        assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
        streamed = [d async for d in engine.stream(prompt_token_ids=PROMPT,
                                                    params=greedy(40, stop=(stop, "\x00\x01")))]
        assert "".join(d.text for d in streamed) == cut.text


async def test_stop_token_ids_eos_and_max_tokens(tiny_path):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        free = await engine.generate(prompt_token_ids=PROMPT, params=greedy(24))
        stop_tok = free.token_ids[6]
        first = free.token_ids.index(stop_tok)
        out = await engine.generate(prompt_token_ids=PROMPT,
                                    params=greedy(24, stop_token_ids=(stop_tok,)))
        assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
        short = await engine.generate(prompt_token_ids=PROMPT, params=greedy(3))
        assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"
        # Greedy without ignore_eos stops at the model's eos if it samples it.
        eos = engine.tokenizer.eos_token_id
        natural = await engine.generate(
            prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=24, temperature=0.0)
        )
        if eos in free.token_ids:
            assert natural.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
            assert natural.finish_reason == "stop"
        else:
            assert natural.token_ids == free.token_ids


async def test_logprobs_are_a_distribution_and_top1_is_greedy(tiny_path):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        out = await engine.generate(prompt_token_ids=PROMPT, params=greedy(10, logprobs=5))
        assert out.logprobs is not None and len(out.logprobs) == 10
        for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
            assert 5 <= len(entry) <= 6 and tok in entry
            assert max(entry, key=entry.get) == tok
            assert all(v <= 0 for v in entry.values())
            assert sum(math.exp(v) for v in entry.values()) <= 1 + 1e-5
        sampled = await engine.generate(prompt_token_ids=PROMPT, params=SamplingParams(
            max_tokens=10, temperature=1.0, seed=3, logprobs=0))
        assert [list(e) for e in sampled.logprobs] == [[t] for t in sampled.token_ids]


async def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_path):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        def params(seed: int) -> SamplingParams:
            return SamplingParams(max_tokens=24, temperature=1.0, top_k=50, top_p=0.9,
                                  seed=seed, ignore_eos=True)

        alone = await engine.generate(prompt_token_ids=PROMPT, params=params(11))
        results = {}

        async def run(name: str, prompt: list[int], p: SamplingParams) -> None:
            results[name] = await engine.generate(prompt_token_ids=prompt, params=p)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "same", PROMPT, params(11))
            tg.start_soon(run, "other", PROMPT, params(12))
            tg.start_soon(run, "noise", list(range(1, 30)), params(5))
        assert results["same"].token_ids == alone.token_ids
        assert results["other"].token_ids != alone.token_ids


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"prompt_token_ids": [1], "params": {"max_tokens": 3}}, "params"),
        ({"prompt_token_ids": [1], "request_id": ""}, "request_id"),
        ({"prompt_token_ids": [1] * 300}, "prompt"),
        ({"prompt_token_ids": [1] * 200, "params": SamplingParams(max_tokens=100)}, "max_tokens"),
    ],
)
async def test_bad_arguments_raise_a_typed_error_naming_the_field(tiny_path, kwargs, field):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        with pytest.raises(InvalidRequestError) as err:
            await engine.generate(**kwargs)
        assert err.value.field == field
        with pytest.raises(InvalidRequestError, match="messages"):
            await engine.chat([{"role": "user"}])
        assert engine.stats()["requests_in_flight"] == 0 and engine.stats()["pages_used"] == 0


async def test_typed_errors_for_params_mode_and_duplicate_ids(tiny_path):
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    for seed in (-1, 1 << 63):  # torch generators take a signed 64-bit seed
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams(seed=seed)
    with pytest.raises(InvalidRequestError) as err:
        Engine(model="tiny", mode="bogus")
    assert err.value.field == "mode"
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        with pytest.raises(PromptTooLongError):
            engine.stream(prompt_token_ids=[1] * 257)
        stream = engine.stream(prompt_token_ids=[1, 2], params=greedy(50), request_id="dup")
        with pytest.raises(InvalidRequestError) as err:
            engine.stream(prompt_token_ids=[1, 2], request_id="dup")
        assert err.value.field == "request_id"
        await stream.aclose()


async def test_abort_ends_the_stream_and_frees_pages(tiny_path):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        stream = engine.stream(prompt_token_ids=PROMPT, params=greedy(200), request_id="a")
        got = [await stream.__anext__(), await stream.__anext__()]
        assert engine.abort("a") and not engine.abort("nope")
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "abort" and len(got) + len(rest) < 200
        stats = await wait_idle(engine)
        assert stats["pages_used"] == 0 and stats["requests_aborted"] == 1


async def test_leaving_a_stream_early_aborts_the_request(tiny_path):
    async with ColocatedEngine(str(tiny_path), scheduler_config=SMALL) as engine:
        async for _ in engine.stream(prompt_token_ids=PROMPT, params=greedy(200)):
            break  # the dropped iterator aborts
        stream = engine.stream(prompt_token_ids=PROMPT, params=greedy(200))
        await stream.__anext__()
        await stream.aclose()
        async with anyio.create_task_group() as tg:  # a cancelled generate aborts its request
            tg.start_soon(lambda: engine.generate(prompt_token_ids=PROMPT, params=greedy(240)))
            while not engine.stats()["running"]:
                await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
        stats = await wait_idle(engine)
        assert stats["requests_aborted"] == 3 and stats["pages_used"] == 0


async def test_no_page_leaks_after_completed_aborted_and_preempted_requests(tiny_path):
    # 12 pages of 2 tokens: four requests of 6 + 16 tokens cannot all stay resident.
    tight = SchedulerConfig(page_size=2, num_pages=12, chunk_tokens=8, max_model_len=64)
    prompts = [[256, *range(60 + 7 * i, 65 + 7 * i)] for i in range(4)]
    async with ColocatedEngine(str(tiny_path), scheduler_config=tight) as engine:
        alone = [(await engine.generate(prompt_token_ids=p, params=greedy(16))).token_ids
                 for p in prompts]
        results: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            results[i] = (await engine.generate(prompt_token_ids=prompts[i],
                                                params=greedy(16))).token_ids

        async def aborted(i: int) -> None:
            async for _ in engine.stream(prompt_token_ids=prompts[i], params=greedy(16)):
                break

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
            tg.start_soon(aborted, 0)
            tg.start_soon(aborted, 1)
        stats = await wait_idle(engine)
        assert stats["preemptions"] > 0, "the tight pool should have forced a preemption"
        assert [results[i] for i in range(4)] == alone  # recompute after preemption is exact
        assert stats["pages_used"] == 0 and stats["waiting"] == 0 and stats["running"] == 0
        assert stats["requests_aborted"] == 2


class _Exploding:
    def forward(self, batch, kv_pool):
        raise RuntimeError("boom")


async def test_a_crash_in_the_loop_surfaces_instead_of_hanging(tiny_path):
    engine = ColocatedEngine(str(tiny_path), scheduler_config=SMALL)
    failures: list[BaseException] = []
    with pytest.raises(BaseExceptionGroup) as group:
        async with engine:
            engine.core.runner.model = _Exploding()
            try:
                await engine.generate(prompt_token_ids=PROMPT, params=greedy(4))
            except RequestFailedError as exc:
                failures.append(exc)
            await anyio.sleep(5)  # cancelled by the crash
    assert group.group_contains(RuntimeError, match="boom")
    with pytest.raises(RequestFailedError):
        engine.stream(prompt_token_ids=PROMPT)
