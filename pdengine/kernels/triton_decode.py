"""Triton split-KV paged decode attention: split partials + log-sum-exp, then a merge.

Stage 1 runs one program per (sequence, KV head, split). The program handles the
whole GQA group of that KV head (padded to a 16-row tile so ``tl.dot`` is legal on
every GPU), walks its slice of the context tile by tile through the page table,
and writes its normalised partial output plus its log-sum-exp (base 2).
A split whose slice is empty (short sequence in a batch) writes lse = -inf and
weighs nothing in the merge; a sequence of length 0 merges to zeros. Stage 2 runs one program per (sequence, Q head)
and combines the splits with max-shifted weights. Any split count gives the same
result up to float rounding (DESIGN.md §1.6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdengine.kernels.checks import check_decode
from pdengine.kernels.chooser import choose_num_kv_splits
from pdengine.kernels.configs import decode_config, interpreting, num_sms

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, PageTable, SeqLens, PartOut, PartLse,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    # Each split covers a whole number of tiles; trailing splits may be empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    hmask = rows < GROUP
    heads = kv_head * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    pt_row = PageTable + b.to(tl.int64) * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
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
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptr = PartOut + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptr, out, mask=hmask[:, None] & dmask[None, :])
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(
    PartOut, PartLse, Out, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    lse = tl.load(PartLse + b * stride_lb + head * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence: every split is empty
    w = tl.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
    part = tl.load(PartOut + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=smask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] attends to each sequence's seq_lens[b] paged tokens -> [B, Hq, D].

    A sequence of length 0 (a padding row of a fixed-size batch) gets zeros.

    ``num_kv_splits=None`` asks ``choose_num_kv_splits`` with ``max_seq_len`` (a host-side
    hint the scheduler knows), or else the page table's capacity
    (``max_pages * page_size``), so choosing never synchronises with the device.
    """
    check_decode(q, k_cache, v_cache, page_table, seq_lens, num_kv_splits)
    b, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    if d < 16:
        raise ValueError(f"q: head_dim {d} < 16, the smallest tl.dot tile on GPUs")
    out = torch.empty_like(q)
    if b == 0:
        return out
    if num_kv_splits is None:
        bound = max_seq_len if max_seq_len is not None else page_table.shape[1] * page_size
        num_kv_splits = choose_num_kv_splits(b, hq, hkv, bound, num_sms(q.device))
    cfg = decode_config(q.device, d)
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    part_out = torch.empty((b, hq, num_kv_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, hq, num_kv_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, hkv, num_kv_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse,
        sm_scale * _LOG2E, num_kv_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_N=cfg.block_n,
        UPCAST=interpreting(),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _decode_merge_kernel[(b, hq)](
        part_out, part_lse, out, num_kv_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
        num_warps=1 if interpreting() else 4,
    )  # fmt: skip
    return out


def decode_kv_bytes(seq_lens: torch.Tensor, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V a decode launch must read (the bandwidth benchmark's numerator)."""
    return int(seq_lens.sum()) * num_kv_heads * head_dim * itemsize * 2

