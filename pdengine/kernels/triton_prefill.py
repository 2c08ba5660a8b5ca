"""Triton paged prefill attention: causal, variable lengths, over a paged prefix.

One program per (query tile, Q head, sequence). Sequence b's new tokens are the
rows ``cu_q_lens[b]:cu_q_lens[b+1]`` of the flattened q and the last ``q_len`` of
its ``seq_lens[b]`` context tokens, whose K/V are already in the cache. A query at
absolute position p reads K/V tiles through the page table up to p (online
softmax, base-2 exponentials). Chunked prefill (a prefix already cached) and
decode (q_len = 1) are special cases.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdengine.kernels.checks import check_prefill
from pdengine.kernels.configs import interpreting, prefill_config

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    Q, KCache, VCache, PageTable, CuQLens, SeqLens, Out,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CuQLens + b)
    q_len = tl.load(CuQLens + b + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx = tl.load(SeqLens + b)
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        pos = ctx - q_len + rows  # absolute position of each query row
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        tok = (q_start + rows).to(tl.int64)
        q = tl.load(Q + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        pt_row = PageTable + b.to(tl.int64) * stride_ptb
        # Causal bound: the tile's last valid row sees up to its own position.
        kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
        for n0 in range(0, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < kv_end
            page = tl.load(pt_row + n // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
            off = n % PAGE_SIZE
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(KCache + page[:, None] * stride_kp + off[:, None] * stride_ks
                        + kv_head * stride_kh + d[None, :], mask=kvmask, other=0.0)  # fmt: skip
            v = tl.load(VCache + page[:, None] * stride_vp + off[:, None] * stride_vs
                        + kv_head * stride_vh + d[None, :], mask=kvmask, other=0.0)  # fmt: skip
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = nmask[None, :] & (n[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Padding rows (>= q_len) are never stored; guard their division anyway.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptr = Out + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over their paged context -> [T, Hq, D].

    ``max_q_len`` (host-side, the longest new-token run) sizes the grid; without it the
    launcher reads ``cu_q_lens`` back from the device once.
    """
    check_prefill(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens)
    t, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    if d < 16:
        raise ValueError(f"q: head_dim {d} < 16, the smallest tl.dot tile on GPUs")
    out = torch.empty_like(q)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    if max_q_len <= 0:
        return out
    cfg = prefill_config(q.device, d)
    grid = (triton.cdiv(max_q_len, cfg.block_m), hq, b)
    _prefill_kernel[grid](
        q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, out,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        PAGE_SIZE=page_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        UPCAST=interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
