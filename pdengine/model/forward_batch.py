"""The contract between the scheduler (who plans a step) and a model (who runs it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One forward step over B sequences whose T new tokens are flattened.

    The new tokens' K/V are first scattered into the paged pool at
    `slot_mapping` (page * page_size + offset), then each sequence attends
    causally over its whole paged context of `seq_lens[b]` tokens, whose last
    `q_len[b] = cu_q_lens[b+1] - cu_q_lens[b]` tokens are the new ones.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu_q_lens: torch.Tensor  # [B+1] int32, prefix sum of new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    page_table: torch.Tensor  # [B, max_pages] int32, pool page index per sequence page
    slot_mapping: torch.Tensor  # [T] int64
    is_decode: bool  # every sequence has exactly one new token
    logits_indices: torch.Tensor  # [B] int64 index into T of each sequence's last token
    # Host-side maxima the planner already knows; kernels size their grids from them
    # instead of reading device tensors back (None: the kernel derives them).
    max_seq_len: int | None = None
    max_q_len: int | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])
