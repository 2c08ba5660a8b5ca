"""Torch reference twins of the Triton kernels — and the CPU serving path.

Same signatures and semantics as the Triton kernels (see ``__init__``). They
are exact (no KV splitting), vectorised over tokens and heads, and use
``scaled_dot_product_attention`` so the CPU path is reasonably fast:
decode is one batched SDPA call over the gathered pages of all sequences
(or one call per sequence when padding to the longest would dominate);
prefill loops over sequences only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdengine.kernels.checks import check_decode, check_prefill, check_store


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k, v [T, Hkv, D] into the page views at slot = page*page_size + offset.

    Negative slots are padding and are skipped.
    """
    check_store(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    page_size = k_cache.shape[1]
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    offsets = slot_mapping - pages * page_size
    # Advanced-index assignment writes through arbitrary (non-contiguous) view strides.
    k_cache[pages, offsets] = k
    v_cache[pages, offsets] = v


# Decode batches whose padding to the longest sequence would more than double the
# gathered tokens are attended one sequence at a time instead.
_RAGGED_PADDING_FACTOR = 2


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, S, H, D], pages [..., n] -> [..., n*S, H, D] (tokens in order)."""
    g = cache[pages]  # [..., n, S, H, D]
    return g.flatten(-4, -3)


def _sequence_kv(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached tokens, head-major: [Hkv, length, D]."""
    pages = table_row[: -(-length // cache.shape[1])].long()
    return _gather_pages(cache, pages)[:length].transpose(0, 1)


def _decode_ragged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    lens: list[int], sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    out = torch.zeros_like(q)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k = _sequence_kv(k_cache, page_table[b], n)
        v = _sequence_kv(v_cache, page_table[b], n)
        o = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=sm_scale,
                                           enable_gqa=True)  # fmt: skip
        out[b] = o.squeeze(1)
    return out


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
    """One new token per sequence: q [B, Hq, D] attends to its seq_lens[b] cached tokens.

    A sequence of length 0 (a padding row of a fixed-size batch) gets zeros.

    ``num_kv_splits`` and ``max_seq_len`` are accepted for signature parity and
    ignored: the twin is exact and reads the lengths itself.
    """
    check_decode(q, k_cache, v_cache, page_table, seq_lens, num_kv_splits)
    b, hq, d = q.shape
    if b == 0:
        return q.new_empty((0, hq, d))
    page_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    max_len = max(lens)
    if max_len == 0:
        return torch.zeros_like(q)
    if b * max_len > _RAGGED_PADDING_FACTOR * sum(lens):
        return _decode_ragged(q, k_cache, v_cache, page_table, lens, sm_scale)
    n_pages = -(-max_len // page_size)
    # Pages past a sequence's end may hold padding indices: clamp them to a valid
    # page and mask the tokens out.
    pages = page_table[:, :n_pages].long().clamp(0, k_cache.shape[0] - 1)
    k = _gather_pages(k_cache, pages).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_pages(v_cache, pages).transpose(1, 2)
    pos = torch.arange(n_pages * page_size, device=q.device)
    mask = (pos[None, :] < seq_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True
    )
    # A padding row (length 0) has every key masked: zeros, not NaN.
    return out.squeeze(2).masked_fill((seq_lens == 0)[:, None, None], 0.0)


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
    """Causal attention of the new tokens q [T, Hq, D] over each sequence's paged context.

    Sequence b owns rows cu_q_lens[b]:cu_q_lens[b+1] of q; they are the last q_len_b of
    its seq_lens[b] tokens (already stored in the cache). A query at absolute position
    p attends to cache positions <= p. ``max_q_len`` is accepted for parity and unused.
    """
    check_prefill(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens)
    out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    lens = seq_lens.tolist()
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > ctx:
            raise ValueError(f"cu_q_lens: sequence {b} has {q_len} new tokens > seq_lens {ctx}")
        k = _sequence_kv(k_cache, page_table[b], ctx)
        v = _sequence_kv(v_cache, page_table[b], ctx)
        # A leading batch dimension of 1 selects SDPA's faster CPU kernel (~25% here).
        qb = q[start:end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        k, v = k[None], v[None]
        if q_len == ctx:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=sm_scale,
                                               enable_gqa=True)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows  # [q_len, L]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[None, None],
                                               scale=sm_scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out
