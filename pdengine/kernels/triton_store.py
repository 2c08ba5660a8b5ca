"""Triton kernel: scatter new K/V tokens into their pages of the paged pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdengine.kernels.checks import check_store


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch,
    stride_vcp, stride_vcs, stride_vch,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(Slots + tok)
    if slot >= 0:  # negative slots are padding and are skipped
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        k = tl.load(K + tok * stride_kt + head * stride_kh + d, mask=dmask)
        v = tl.load(V + tok * stride_vt + head * stride_vh + d, mask=dmask)
        kdst = KCache + page * stride_kcp + off * stride_kcs + head * stride_kch + d
        vdst = VCache + page * stride_vcp + off * stride_vcs + head * stride_vch + d
        tl.store(kdst, k, mask=dmask)
        tl.store(vdst, v, mask=dmask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] at slot = page*page_size + offset of the page views."""
    check_store(k, v, k_cache, v_cache, slot_mapping)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k/v: head_dim must be unit-stride")
    t, hkv, d = k.shape
    if t == 0:
        return
    _store_kv_kernel[(t, hkv)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
