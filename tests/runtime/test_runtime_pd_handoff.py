"""The runtime's PD entry points composed by hand: prefill-only core -> page copy -> add_prefilled.

No transport: pages are copied tensor to tensor, chunk by chunk, as each chunk reports
them complete. The decoded tokens must equal the colocated engine's.
"""

from __future__ import annotations

from pdengine.config import SchedulerConfig
from pdengine.runtime import EngineCore, SeqStatus, Sequence
from pdengine.types import SamplingParams

PROMPT = [256, *[(i * 29 + 5) % 250 for i in range(37)]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CFG = SchedulerConfig(page_size=4, num_pages=64, chunk_tokens=8, max_model_len=256)


def test_prefill_only_then_add_prefilled_equals_colocated(llama_path):
    colocated, _ = EngineCore.load(llama_path, CFG)
    ref = Sequence("ref", PROMPT, PARAMS)
    colocated.scheduler.add(ref)
    while colocated.scheduler.has_work():
        colocated.step()

    prefill, _ = EngineCore.load(llama_path, CFG, prefill_only=True)
    decode = EngineCore(prefill.model, CFG)
    decode.pool.allocator.alloc(5)  # decode-side pages differ from prefill-side ones
    dst = decode.pool.allocator.alloc(-(-len(PROMPT) // CFG.page_size))
    seq = Sequence("pd", PROMPT, PARAMS)
    prefill.scheduler.add(seq)
    copied: list[int] = []
    while seq.status is not SeqStatus.PREFILLED:
        _, out = prefill.step()
        for chunk in out.chunks:
            for index, page in zip(chunk.page_indices, chunk.pages, strict=True):
                decode.pool.tensor[dst[index]] = prefill.pool.tensor[page]
                copied.append(index)
    assert copied == list(range(len(dst)))  # every page reported once, in order
    first = seq.output_token_ids[0]
    prefill.scheduler.release(seq)
    assert prefill.pool.allocator.num_used == 0

    mine = Sequence("pd", PROMPT, PARAMS)
    decode.scheduler.add_prefilled(mine, dst, first)
    while decode.scheduler.has_work():
        decode.step()
    assert mine.output_token_ids == ref.output_token_ids
    assert decode.pool.allocator.num_used == 5
