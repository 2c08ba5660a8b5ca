"""The torch twins (CPU serving path and the Triton kernels' oracle) against naive dense
attention computed token by token in float64."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import dense_attention, make_paged_kv, seq_lengths, tolerance

from pdengine.kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (batch, max kv len, page size, gqa ratio, dtype): every axis value appears.
CASES = [
    (1, 1, 1, 1, torch.float32),
    (3, 15, 16, 4, torch.float16),
    (8, 16, 1, 4, torch.bfloat16),
    (3, 17, 1, 1, torch.float32),
    (8, 100, 16, 1, torch.float16),
    (1, 1000, 16, 4, torch.bfloat16),
    (3, 1000, 1, 1, torch.float32),
    (8, 1, 16, 4, torch.float32),
]


@pytest.mark.parametrize(("batch", "max_len", "page_size", "ratio", "dtype"), CASES)
def test_decode_twin_matches_dense(batch, max_len, page_size, ratio, dtype):
    gen = torch.Generator().manual_seed(batch * 1000 + max_len)
    hkv, d = 2, 32
    kv = make_paged_kv(seq_lengths(batch, max_len, gen), page_size, hkv, d, dtype, gen)
    q = torch.randn(batch, hkv * ratio, d, generator=gen).to(dtype)
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                           kv.seq_lens, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    for b in range(batch):
        n = int(kv.seq_lens[b])
        ref = dense_attention(q[b : b + 1], kv.tokens(b, kv.k_cache), kv.tokens(b, kv.v_cache),
                              [n - 1], 0.3)
        torch.testing.assert_close(out[b].double(), ref[0], **tolerance(dtype))


@pytest.mark.parametrize("padding_factor", [0, 10**9], ids=["per-sequence", "batched"])
def test_decode_twin_both_paths_match_dense(monkeypatch, padding_factor):
    monkeypatch.setattr(reference, "_RAGGED_PADDING_FACTOR", padding_factor)
    gen = torch.Generator().manual_seed(77)
    kv = make_paged_kv([300, 1, 17, 2], 16, 2, 16, torch.float32, gen)
    kv.seq_lens[3] = 0  # a padding row
    q = torch.randn(4, 8, 16, generator=gen)
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                           kv.seq_lens, 0.3)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    for b in range(3):
        n = int(kv.seq_lens[b])
        ref = dense_attention(q[b : b + 1], kv.tokens(b, kv.k_cache), kv.tokens(b, kv.v_cache),
                              [n - 1], 0.3)
        torch.testing.assert_close(out[b].double(), ref[0], **tolerance(torch.float32))


# (batch, context lens, new tokens per sequence, page size, gqa ratio, dtype)
PREFILL_CASES = [
    (1, [16], [16], 16, 1, torch.float32),  # whole prompt
    (3, [17, 100, 1], [17, 30, 1], 1, 4, torch.float16),  # mixed full / chunked
    (3, [1000, 15, 40], [20, 15, 1], 16, 4, torch.bfloat16),  # long prefix chunk + decode row
    (8, [5, 9, 16, 17, 1, 3, 100, 33], [5, 1, 8, 17, 1, 2, 50, 1], 16, 1, torch.float32),
]


@pytest.mark.parametrize(("batch", "lens", "q_lens", "page_size", "ratio", "dtype"),
                         PREFILL_CASES)
def test_prefill_twin_matches_dense(batch, lens, q_lens, page_size, ratio, dtype):
    gen = torch.Generator().manual_seed(sum(lens))
    hkv, d = 2, 32
    kv = make_paged_kv(lens, page_size, hkv, d, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hkv * ratio, d, generator=gen).to(dtype)
    out = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.page_table, cu,
                                            kv.seq_lens, 0.25)
    for b in range(batch):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        positions = list(range(lens[b] - q_lens[b], lens[b]))
        ref = dense_attention(q[rows], kv.tokens(b, kv.k_cache), kv.tokens(b, kv.v_cache),
                              positions, 0.25)
        torch.testing.assert_close(out[rows].double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("page_size", [1, 16])
def test_store_twin_writes_only_its_slots_through_strided_views(page_size):
    gen = torch.Generator().manual_seed(page_size)
    kv = make_paged_kv([20, 7], page_size, 2, 16, torch.float32, gen)
    before = kv.pool.clone()
    slots = torch.tensor([0, 3 * page_size + page_size - 1, -1, 5], dtype=torch.int64)
    k = torch.randn(4, 2, 16, generator=gen)
    v = torch.randn(4, 2, 16, generator=gen)
    reference.store_kv(k, v, kv.k_cache, kv.v_cache, slots)
    changed = torch.zeros_like(kv.pool, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, off = divmod(slot, page_size)
        assert torch.equal(kv.pool[page, 1, 0, off], k[i])
        assert torch.equal(kv.pool[page, 1, 1, off], v[i])
        changed[page, 1, :, off] = True
    # Nothing else in the pool (other layers, other slots, the padding token) moved.
    assert torch.equal(kv.pool[~changed], before[~changed])


def test_twin_rejects_bad_shapes_with_named_field():
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv([4], 16, 2, 16, torch.float32, gen)
    q = torch.randn(1, 3, 16)  # 3 q heads over 2 kv heads
    with pytest.raises(ValueError, match="num_q_heads"):
        reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                         kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="page_table"):
        reference.paged_decode_attention(torch.randn(1, 2, 16), kv.k_cache, kv.v_cache,
                                         kv.page_table.long(), kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.store_kv(torch.randn(2, 2, 16), torch.randn(2, 2, 16), kv.k_cache,
                           kv.v_cache, torch.tensor([0], dtype=torch.int64))
    with pytest.raises(ValueError, match="cu_q_lens"):
        reference.paged_prefill_attention(torch.randn(5, 2, 16), kv.k_cache, kv.v_cache,
                                          kv.page_table, torch.tensor([0, 5], dtype=torch.int32),
                                          kv.seq_lens, 1.0)
