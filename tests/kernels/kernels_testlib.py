"""Shared builders for the kernel tests: paged pools with strided views, page tables,
and a deliberately naive dense attention (float64, per token) that checks the twins."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_LAYERS = 3  # the tests use layer 1 so neither the page nor the layer stride is trivial
LAYER = 1


@dataclass
class PagedKV:
    pool: torch.Tensor  # [P, layers, 2, S, Hkv, D]
    k_cache: torch.Tensor  # pool[:, LAYER, 0], non-contiguous view
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, padded with -1
    seq_lens: torch.Tensor  # [B] int32

    def tokens(self, b: int, cache: torch.Tensor) -> torch.Tensor:
        """The sequence's cached tokens [L, Hkv, D], gathered one token at a time."""
        s = cache.shape[1]
        length = int(self.seq_lens[b])
        rows = [cache[int(self.page_table[b, i // s]), i % s] for i in range(length)]
        return torch.stack(rows)


def seq_lengths(batch: int, max_len: int, gen: torch.Generator) -> list[int]:
    """``batch`` lengths in [1, max_len] whose maximum is exactly ``max_len``."""
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[int(torch.randint(0, batch, (1,), generator=gen))] = max_len
    return lens


def make_paged_kv(
    lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedKV:
    """A random pool whose pages are handed to the sequences in shuffled order."""
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 2  # spare pages that no sequence owns
    shape = (num_pages, NUM_LAYERS, 2, page_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)
    width = max(pages_per_seq) + 1
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    return PagedKV(
        pool=pool,
        k_cache=pool[:, LAYER, 0],
        v_cache=pool[:, LAYER, 1],
        page_table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
    )


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], scale: float
) -> torch.Tensor:
    """Naive causal attention in float64: q [n, Hq, D] at absolute ``positions`` over
    k, v [L, Hkv, D]; query i sees keys 0..positions[i]."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    out = []
    for i, p in enumerate(positions):
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k64[: p + 1]) * scale
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v64[: p + 1]))
    return torch.stack(out)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Output tolerance against an fp32 computation on the same (rounded) inputs."""
    return {
        torch.float32: {"atol": 2e-5, "rtol": 1e-4},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
        torch.bfloat16: {"atol": 1.5e-2, "rtol": 1.5e-2},
    }[dtype]


def as_fp32(kv: PagedKV) -> PagedKV:
    """The same paged KV upcast to float32 (same page table), for reference runs."""
    pool = kv.pool.float()
    return PagedKV(pool, pool[:, LAYER, 0], pool[:, LAYER, 1], kv.page_table, kv.seq_lens)
