"""ModelRunner: turns a scheduled step into a ForwardBatch, runs the model, samples.

It is the one object that touches the device for a worker: the KV pool and
the model. `step()` is synchronous and meant to run in the engine's compute
thread; nothing else may use the pool or the model meanwhile.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Protocol

import torch

from pdengine.cache import KVPool
from pdengine.model.forward_batch import ForwardBatch
from pdengine.runtime.sampler import sample
from pdengine.runtime.scheduler import ScheduledStep
from pdengine.runtime.sequence import SeqStatus


class ForwardModel(Protocol):
    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: ForwardModel, kv_pool: KVPool,
                 split_mixed_steps: bool | None = None) -> None:
        self.model = model
        # Default: split on CUDA, where decodes get the split-KV decode kernel. On CPU the
        # prefill twin attends one-token rows in batches itself, and one forward over all
        # tokens runs the matmuls once (about 7% less time in mixed steps).
        if split_mixed_steps is None:
            split_mixed_steps = kv_pool.device.type == "cuda"
        self.split_mixed_steps = split_mixed_steps
        self.kv_pool = kv_pool
        self.device = kv_pool.device

    def build_batch(self, step: ScheduledStep) -> ForwardBatch:
        ps = self.kv_pool.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        if step.is_decode:  # the hot path: one token per sequence
            for it in step.items:
                seq, pos = it.seq, it.start
                pages = seq.page_table.pages  # type: ignore[union-attr]
                input_ids.append(seq.token_ids[pos])
                slots.append(pages[pos // ps] * ps + pos % ps)
                seq_lens.append(pos + 1)
                tables.append(pages)
            positions = [n - 1 for n in seq_lens]
            cu = list(range(len(step.items) + 1))
        else:
            cu = [0]
            for it in step.items:
                seq, table = it.seq, it.seq.page_table
                assert table is not None, f"{seq} is scheduled without pages"
                input_ids += seq.token_ids[it.start : it.end]
                positions += range(it.start, it.end)
                slots += table.slots(it.start, it.end)
                cu.append(cu[-1] + it.num_tokens)
                seq_lens.append(it.end)
                tables.append(table.pages[: -(-it.end // ps)])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) if len(t) < width else t for t in tables]
        dev = self.device
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            cu_q_lens=cu_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            is_decode=step.is_decode,
            logits_indices=(cu_t[1:] - 1).to(torch.int64),
            max_seq_len=max(seq_lens),
            max_q_len=max(b - a for a, b in pairwise(cu)),
        )

    @torch.inference_mode()
    def forward(self, step: ScheduledStep) -> torch.Tensor:
        """Logits [B, vocab] fp32 of each scheduled sequence's last new token.

        With `split_mixed_steps`, a step mixing decodes with prefill chunks runs
        as two forwards, decodes first (the scheduler orders them so), so the
        decodes get the decode attention kernel.
        """
        items = step.items
        n_dec = 0
        while n_dec < len(items) and items[n_dec].seq.status is SeqStatus.DECODING:
            n_dec += 1
        if step.is_decode or not self.split_mixed_steps or n_dec < 2:
            return self.model.forward(self.build_batch(step), self.kv_pool.tensor)
        decode = ScheduledStep(items[:n_dec], is_decode=True)
        prefill = ScheduledStep(items[n_dec:], is_decode=False)
        return torch.cat([
            self.model.forward(self.build_batch(decode), self.kv_pool.tensor),
            self.model.forward(self.build_batch(prefill), self.kv_pool.tensor),
        ])

    @torch.inference_mode()
    def step(self, step: ScheduledStep) -> tuple[list[int], list[dict[int, float] | None]]:
        """Forward, then sample the rows that finish their known tokens (-1 elsewhere).

        Rows in the middle of a chunked prefill are not sampled, so a seeded
        request draws the same random numbers however its prompt was chunked.
        """
        logits = self.forward(step)
        rows = [k for k, it in enumerate(step.items) if it.samples]
        tokens = [-1] * len(step.items)
        logprobs: list[dict[int, float] | None] = [None] * len(step.items)
        if rows:
            if len(rows) < len(step.items):
                logits = logits[rows]
            got, lps = sample(logits, [step.items[k].seq for k in rows])
            for j, k in enumerate(rows):
                tokens[k] = got[j]
                if lps is not None:
                    logprobs[k] = lps[j]
        return tokens, logprobs
