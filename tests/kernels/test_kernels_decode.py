"""Triton split-KV decode attention (interpreter on CPU) against the torch twin, and
split invariance: the regression test for the production bug of DESIGN.md §1.6."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import as_fp32, make_paged_kv, seq_lengths, tolerance

from pdengine.kernels import choose_num_kv_splits, reference
from pdengine.kernels import triton_decode as td

# (batch, max kv len, page size, gqa ratio, head_dim, dtype): every axis value appears;
# head_dim 24 exercises a non-power-of-two head.
CASES = [
    (1, 1, 1, 1, 32, torch.float32),
    (3, 15, 16, 4, 32, torch.float16),
    (8, 16, 1, 4, 16, torch.bfloat16),
    (3, 17, 16, 1, 24, torch.float32),
    (8, 100, 16, 1, 32, torch.float16),
    (1, 100, 1, 4, 32, torch.bfloat16),
    (3, 1000, 16, 4, 16, torch.float32),
    (8, 17, 1, 1, 32, torch.bfloat16),
    (8, 1000, 1, 1, 32, torch.float16),
    (1, 1000, 16, 4, 64, torch.bfloat16),
]
SLOW_CASES = [
    (3, 4096, 16, 4, 64, torch.bfloat16),
]


def _run_case(batch, max_len, page_size, ratio, head_dim, dtype, splits=None):
    gen = torch.Generator().manual_seed(batch * 7919 + max_len * 31 + page_size)
    hkv = 2
    kv = make_paged_kv(seq_lengths(batch, max_len, gen), page_size, hkv, head_dim, dtype, gen)
    # q is a slice of a wider tensor, as when the model splits a fused qkv projection
    q = torch.randn(batch, hkv * ratio, 2 * head_dim, generator=gen).to(dtype)[..., :head_dim]
    ref32 = as_fp32(kv)
    expected = reference.paged_decode_attention(q.float(), ref32.k_cache, ref32.v_cache,
                                                kv.page_table, kv.seq_lens, 0.2)
    out = td.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens,
                                    0.2, splits)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))


@pytest.mark.parametrize(("batch", "max_len", "page_size", "ratio", "head_dim", "dtype"), CASES)
def test_decode_matches_twin(batch, max_len, page_size, ratio, head_dim, dtype):
    _run_case(batch, max_len, page_size, ratio, head_dim, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "max_len", "page_size", "ratio", "head_dim", "dtype"),
                         SLOW_CASES)
def test_decode_matches_twin_large(batch, max_len, page_size, ratio, head_dim, dtype):
    _run_case(batch, max_len, page_size, ratio, head_dim, dtype)


def _split_outputs(kv, q, splits_list):
    return {
        s: td.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens,
                                     0.25, s)
        for s in splits_list
    }


@pytest.mark.parametrize(
    ("lens", "page_size"),
    [
        ([1, 15, 16, 17, 100, 3, 64, 40], 16),  # batch 8: most splits of short rows are empty
        ([1000, 2, 33], 1),
    ],
)
def test_decode_split_invariance(lens, page_size):
    gen = torch.Generator().manual_seed(len(lens))
    kv = make_paged_kv(lens, page_size, 2, 16, torch.float32, gen)
    q = torch.randn(len(lens), 4, 16, generator=gen)
    chosen = choose_num_kv_splits(len(lens), 4, 2, max(lens), 132)
    outs = _split_outputs(kv, q, [1, 2, 7, chosen])
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                                kv.seq_lens, 0.25)
    for splits, out in outs.items():
        assert torch.isfinite(out).all(), f"num_kv_splits={splits} produced non-finite values"
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4,
                                   msg=lambda m, s=splits: f"num_kv_splits={s}: {m}")


def test_decode_split_invariance_long_context():
    """Batch 1, 4096+ tokens, small head: the chooser splits it, and every split count
    agrees with one split and with the twin."""
    gen = torch.Generator().manual_seed(4099)
    length = 4099
    kv = make_paged_kv([length], 16, 1, 16, torch.float16, gen)
    q = torch.randn(1, 1, 16, generator=gen).to(torch.float16)
    chosen = choose_num_kv_splits(1, 1, 1, length, 132)
    assert chosen > 7, "a batch-1 long context must be split to fill the SMs"
    outs = _split_outputs(kv, q, [1, 2, 7, chosen])
    ref32 = as_fp32(kv)
    expected = reference.paged_decode_attention(q.float(), ref32.k_cache, ref32.v_cache,
                                                kv.page_table, kv.seq_lens, 0.25)
    for splits, out in outs.items():
        torch.testing.assert_close(out.float(), expected, **tolerance(torch.float16),
                                   msg=lambda m, s=splits: f"num_kv_splits={s}: {m}")
        torch.testing.assert_close(out, outs[1], atol=1e-3, rtol=1e-3)


def test_decode_chooser_default_uses_max_seq_len_hint():
    gen = torch.Generator().manual_seed(5)
    kv = make_paged_kv([600, 40], 16, 2, 16, torch.float32, gen)
    q = torch.randn(2, 2, 16, generator=gen)
    hinted = td.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens,
                                       0.25, max_seq_len=600)
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                                kv.seq_lens, 0.25)
    torch.testing.assert_close(hinted, expected, atol=2e-5, rtol=1e-4)


def test_decode_padding_rows_of_length_zero_give_zeros():
    gen = torch.Generator().manual_seed(9)
    kv = make_paged_kv([37, 1, 20], 16, 2, 16, torch.float32, gen)
    kv.seq_lens[1] = 0  # a padding row, as in a fixed-size (graph-captured) batch
    q = torch.randn(3, 4, 16, generator=gen)
    for splits in (1, 3):
        out = td.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                        kv.seq_lens, 0.25, splits)
        twin = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                                kv.seq_lens, 0.25)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.equal(twin[1], torch.zeros_like(twin[1]))
        torch.testing.assert_close(out, twin, atol=2e-5, rtol=1e-4)
    empty = torch.zeros(3, dtype=torch.int32)
    twin = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, empty, 0.25)
    assert torch.equal(twin, torch.zeros_like(q))


def test_decode_launcher_rejects_bad_input():
    gen = torch.Generator().manual_seed(1)
    kv = make_paged_kv([5], 16, 2, 16, torch.float32, gen)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="num_kv_splits"):
        td.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 1.0, 0)
    with pytest.raises(ValueError, match="seq_lens"):
        td.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table,
                                  kv.seq_lens.long(), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        td.paged_decode_attention(q.half(), kv.k_cache, kv.v_cache, kv.page_table,
                                  kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        td.paged_decode_attention(torch.randn(1, 2, 8), kv.k_cache, kv.v_cache, kv.page_table,
                                  kv.seq_lens, 1.0)
    small = make_paged_kv([5], 16, 2, 8, torch.float32, gen)
    with pytest.raises(ValueError, match="head_dim 8 < 16"):
        td.paged_decode_attention(torch.randn(1, 2, 8), small.k_cache, small.v_cache,
                                  small.page_table, small.seq_lens, 1.0)
