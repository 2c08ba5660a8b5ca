"""Test-side driver: runs sequences through `Model.forward` over a real paged pool.

Pages are handed out in a shuffled order so a sequence's pages are never
contiguous in the pool; this is the minimal loop the model tests use in place
of the scheduler.
"""

from __future__ import annotations

import torch

from pdengine.model import ForwardBatch, Model


class PagedRunner:
    def __init__(self, model: Model, num_pages: int = 96, page_size: int = 4, seed: int = 0):
        self.model = model
        self.page_size = page_size
        self.pool = torch.zeros(model.kv_layout(num_pages, page_size).shape, dtype=model.dtype,
                                device=model.device)
        gen = torch.Generator().manual_seed(seed)
        self.free_pages = torch.randperm(num_pages, generator=gen).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]]) -> torch.Tensor:
        """Feed each sequence id its new tokens; returns logits [B, vocab] in dict order."""
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, tokens in new_tokens.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            pages = self.pages.setdefault(seq, [])
            while len(pages) * self.page_size < end:
                pages.append(self.free_pages.pop())
            for pos in range(start, end):
                slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            ids += tokens
            positions += range(start, end)
            q_lens.append(len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        max_pages = max(len(self.pages[s]) for s in new_tokens)
        table = [self.pages[s] + [0] * (max_pages - len(self.pages[s])) for s in new_tokens]
        cu = torch.tensor([0, *q_lens]).cumsum(0)
        dev = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            cu_q_lens=cu.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            is_decode=all(n == 1 for n in q_lens),
            logits_indices=(cu[1:] - 1).to(device=dev, dtype=torch.int64),
        )
        return self.model.forward(batch, self.pool).cpu()


def greedy_generate(model: Model, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None) -> list[list[int]]:
    """All prompts prefilled together, then decoded together; a sequence stops at EOS."""
    runner = PagedRunner(model, num_pages=256)
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = {i: list(p) for i, p in enumerate(prompts)}
    while pending:
        logits = runner.step(pending)
        nxt = logits.argmax(-1).tolist()
        pending_next = {}
        for seq, token in zip(pending, nxt, strict=True):
            outputs[seq].append(token)
            if token != eos_token_id and len(outputs[seq]) < max_new_tokens:
                pending_next[seq] = [token]
        pending = pending_next
    return outputs
