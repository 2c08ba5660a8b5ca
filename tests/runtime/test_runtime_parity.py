"""Greedy parity with transformers `generate`, through the engine, with chunked prefill."""

from __future__ import annotations

import anyio
import pytest
import torch

from pdengine import SamplingParams
from pdengine.config import SchedulerConfig
from pdengine.engine import ColocatedEngine

NEW_TOKENS = 32
PROMPTS = [
    [256, 72, 105],
    [256, *range(40, 50)],
    [256, *[(i * 37) % 250 for i in range(24)]],
    [256, *[(i * 11 + 3) % 250 for i in range(45)]],
]
# Small pages and a chunk budget below most prompt lengths: prompts are prefilled in several
# steps, several at once, while the others decode.
SMALL = SchedulerConfig(page_size=4, num_pages=128, max_batch_size=8, chunk_tokens=8,
                        max_model_len=512)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(llama_path) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    cfg = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            outs.append(seq[0, len(prompt):].tolist())
    return outs


async def _run_concurrently(engine: ColocatedEngine, prompts: list[list[int]]) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        out = await engine.generate(prompt_token_ids=prompts[i], params=GREEDY)
        assert out.finish_reason == "length"
        results[i] = out.token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


async def test_greedy_matches_transformers_generate_for_a_concurrent_batch(llama_path, hf_greedy):
    assert all(len(ref) == NEW_TOKENS for ref in hf_greedy)
    async with ColocatedEngine(str(llama_path), scheduler_config=SMALL) as engine:
        got = await _run_concurrently(engine, PROMPTS)
        assert engine.stats()["pages_used"] == 0
    for prompt, mine, ref in zip(PROMPTS, got, hf_greedy, strict=True):
        assert mine == ref, f"prompt of {len(prompt)} tokens diverged"


async def test_chunked_prefill_equals_one_shot_prefill(llama_path):
    one_shot = SchedulerConfig(page_size=16, num_pages=64, chunk_tokens=512, max_model_len=512)
    outs = []
    for cfg in (one_shot, SMALL):
        async with ColocatedEngine(str(llama_path), scheduler_config=cfg) as engine:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
            outs.append(await engine.generate(prompt_token_ids=PROMPTS[3], params=params))
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        assert a.keys() == b.keys()
        for tok in a:
            assert abs(a[tok] - b[tok]) < 1e-4
