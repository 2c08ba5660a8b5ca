"""Triton paged prefill attention (interpreter on CPU) against the torch twin: full
prompts, chunked prefill over a cached prefix, decode rows, variable lengths, GQA."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import as_fp32, make_paged_kv, tolerance

from pdengine.kernels import reference
from pdengine.kernels import triton_prefill as tp

# (context lens, new tokens per sequence, page size, gqa ratio, head_dim, dtype):
# batch sizes 1, 3, 8 and context lengths 1, 15, 16, 17, 100, ~1000 all appear.
CASES = [
    ([17], [17], 16, 1, 32, torch.float32),  # whole prompt, one partial tile
    ([1], [1], 1, 4, 16, torch.bfloat16),
    ([15, 100, 16], [15, 18, 1], 1, 4, 32, torch.float16),  # full / chunked / decode row
    ([1000, 17, 1], [16, 9, 1], 16, 1, 16, torch.float32),  # long cached prefix
    ([5, 16, 1, 33, 17, 2, 40, 15], [5, 3, 1, 33, 1, 2, 20, 15], 16, 4, 24, torch.bfloat16),
    ([3, 100, 16], [0, 40, 16], 16, 1, 32, torch.float16),  # a sequence with no new tokens
]
SLOW_CASES = [
    ([1000, 300], [200, 300], 1, 4, 32, torch.bfloat16),
    ([4096], [48], 16, 1, 16, torch.float16),
]


def _run(lens, q_lens, page_size, ratio, head_dim, dtype):
    gen = torch.Generator().manual_seed(sum(lens) + page_size)
    hkv = 2
    kv = make_paged_kv(lens, page_size, hkv, head_dim, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    # q is a slice of a fused qkv tensor, with a token stride wider than Hq * D
    qkv = torch.randn(int(cu[-1]), hkv * ratio + 2 * hkv, head_dim, generator=gen).to(dtype)
    q = qkv[:, : hkv * ratio]
    ref32 = as_fp32(kv)
    expected = reference.paged_prefill_attention(q.float(), ref32.k_cache, ref32.v_cache,
                                                 kv.page_table, cu, kv.seq_lens, 0.3)
    out = tp.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.page_table, cu,
                                     kv.seq_lens, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    return out, q, kv, cu


@pytest.mark.parametrize(("lens", "q_lens", "page_size", "ratio", "head_dim", "dtype"), CASES)
def test_prefill_matches_twin(lens, q_lens, page_size, ratio, head_dim, dtype):
    _run(lens, q_lens, page_size, ratio, head_dim, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(("lens", "q_lens", "page_size", "ratio", "head_dim", "dtype"),
                         SLOW_CASES)
def test_prefill_matches_twin_large(lens, q_lens, page_size, ratio, head_dim, dtype):
    _run(lens, q_lens, page_size, ratio, head_dim, dtype)


def test_prefill_max_q_len_hint_gives_same_result():
    out, q, kv, cu = _run([40, 9], [40, 5], 16, 1, 16, torch.float32)
    hinted = tp.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.page_table, cu,
                                        kv.seq_lens, 0.3, max_q_len=40)
    torch.testing.assert_close(hinted, out, atol=0, rtol=0)


def test_prefill_launcher_rejects_bad_input():
    gen = torch.Generator().manual_seed(2)
    kv = make_paged_kv([8], 16, 2, 16, torch.float32, gen)
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_q_lens"):
        tp.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.page_table, cu.long(),
                                   kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match=r"^q: head_dim"):
        tp.paged_prefill_attention(q[:, :, :8], kv.k_cache, kv.v_cache, kv.page_table, cu,
                                   kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        tp.paged_prefill_attention(q, kv.k_cache, kv.v_cache[:, :8], kv.page_table, cu,
                                   kv.seq_lens, 1.0)
