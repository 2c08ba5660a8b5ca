"""Triton store_kv (interpreter on CPU) against the torch twin, through the strided
per-layer views of the 6-D pool."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import make_paged_kv

from pdengine.kernels import reference
from pdengine.kernels import triton_store as ts


@pytest.mark.parametrize(
    ("page_size", "num_tokens", "head_dim", "dtype"),
    [
        (1, 1, 16, torch.float32),
        (16, 17, 24, torch.float16),
        (16, 40, 32, torch.bfloat16),
        (1, 15, 32, torch.float32),
    ],
)
def test_store_matches_twin(page_size, num_tokens, head_dim, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    kv = make_paged_kv([num_tokens + 20, 9], page_size, 2, head_dim, dtype, gen)
    twin_pool = kv.pool.clone()
    capacity = kv.pool.shape[0] * page_size
    slots = torch.randperm(capacity, generator=gen)[:num_tokens].to(torch.int64)
    if num_tokens > 2:
        slots[1] = -1  # a padding token is skipped by both
    k = torch.randn(num_tokens, 2, head_dim, generator=gen).to(dtype)
    # v from a wider tensor: a token stride that is not H*D
    v = torch.randn(num_tokens, 2, head_dim * 2, generator=gen).to(dtype)[:, :, :head_dim]
    ts.store_kv(k, v, kv.k_cache, kv.v_cache, slots)
    reference.store_kv(k, v, twin_pool[:, 1, 0], twin_pool[:, 1, 1], slots)
    assert torch.equal(kv.pool, twin_pool)
    page, off = divmod(int(slots[0]), page_size)
    assert torch.equal(kv.pool[page, 1, 0, off], k[0])


def test_store_launcher_rejects_bad_input():
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([4], 16, 2, 16, torch.float32, gen)
    k = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        ts.store_kv(k, k, kv.k_cache, kv.v_cache, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k/v"):
        ts.store_kv(k.half(), k.half(), kv.k_cache, kv.v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"^k:"):
        ts.store_kv(torch.randn(2, 3, 16), k, kv.k_cache, kv.v_cache, torch.tensor([0, 1]))
