"""Argument checks shared by the Triton launchers and the torch twins.

Every public kernel validates shapes and dtypes on the host before it touches
memory, and raises ``ValueError`` naming the offending argument. The checks
never read device values (that would synchronise the GPU).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"{name}: {msg}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """K/V caches are [num_pages, page_size, Hkv, D] views; return that shape."""
    if k_cache.dim() != 4:
        shape = tuple(k_cache.shape)
        _fail("k_cache", f"expected [num_pages, page_size, Hkv, D], got shape {shape}")
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if k_cache.dtype not in FLOAT_DTYPES:
        _fail("k_cache", f"unsupported dtype {k_cache.dtype}")
    if v_cache.dtype != k_cache.dtype:
        _fail("v_cache", f"dtype {v_cache.dtype} != k_cache {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        _fail("v_cache", "must be on the same device as k_cache")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        _fail("k_cache/v_cache", "head_dim must be the innermost, unit-stride dimension")
    p, s, h, d = k_cache.shape
    return int(p), int(s), int(h), int(d)


def _check_index(
    name: str, t: torch.Tensor, dims: int, dtype: torch.dtype, dev: torch.device
) -> None:
    if t.dim() != dims:
        _fail(name, f"expected {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(name, f"expected dtype {dtype}, got {t.dtype}")
    if t.device != dev:
        _fail(name, f"must be on {dev}, got {t.device}")


def check_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, hkv, d = check_cache(k_cache, v_cache)
    if k.dim() != 3 or tuple(k.shape[1:]) != (hkv, d):
        _fail("k", f"expected [T, {hkv}, {d}], got {tuple(k.shape)}")
    if v.shape != k.shape:
        _fail("v", f"shape {tuple(v.shape)} != k {tuple(k.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        _fail("k/v", f"dtype {k.dtype}/{v.dtype} != cache dtype {k_cache.dtype}")
    _check_index("slot_mapping", slot_mapping, 1, torch.int64, k.device)
    if slot_mapping.shape[0] != k.shape[0]:
        _fail("slot_mapping", f"length {slot_mapping.shape[0]} != number of tokens {k.shape[0]}")


def _check_q(q: torch.Tensor, dims: int, hkv: int, d: int, cache_dtype: torch.dtype) -> int:
    if q.dim() != dims:
        _fail("q", f"expected {dims} dims, got shape {tuple(q.shape)}")
    hq, qd = int(q.shape[-2]), int(q.shape[-1])
    if qd != d:
        _fail("q", f"head_dim {qd} != cache head_dim {d}")
    if hq % hkv != 0:
        _fail("q", f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if q.dtype != cache_dtype:
        _fail("q", f"dtype {q.dtype} != cache dtype {cache_dtype}")
    if q.stride(-1) != 1:
        _fail("q", "head_dim must be unit-stride")
    return hq


def check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: int | None,
) -> None:
    _, _, hkv, d = check_cache(k_cache, v_cache)
    _check_q(q, 3, hkv, d, k_cache.dtype)
    b = q.shape[0]
    _check_index("page_table", page_table, 2, torch.int32, q.device)
    _check_index("seq_lens", seq_lens, 1, torch.int32, q.device)
    if page_table.shape[0] != b:
        _fail("page_table", f"batch {page_table.shape[0]} != q batch {b}")
    if seq_lens.shape[0] != b:
        _fail("seq_lens", f"batch {seq_lens.shape[0]} != q batch {b}")
    if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
        _fail("num_kv_splits", f"must be a positive int or None, got {num_kv_splits!r}")


def check_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _, _, hkv, d = check_cache(k_cache, v_cache)
    _check_q(q, 3, hkv, d, k_cache.dtype)
    _check_index("page_table", page_table, 2, torch.int32, q.device)
    _check_index("cu_q_lens", cu_q_lens, 1, torch.int32, q.device)
    _check_index("seq_lens", seq_lens, 1, torch.int32, q.device)
    b = seq_lens.shape[0]
    if cu_q_lens.shape[0] != b + 1:
        _fail("cu_q_lens", f"expected B+1={b + 1} entries, got {cu_q_lens.shape[0]}")
    if page_table.shape[0] != b:
        _fail("page_table", f"batch {page_table.shape[0]} != seq_lens batch {b}")
