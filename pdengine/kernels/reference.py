"""Torch reference twins of the Triton kernels — and the CPU serving path.

Same signatures and semantics as the Triton kernels (see ``__init__``). They
are exact (no KV splitting), vectorised over tokens and heads, and use
``scaled_dot_product_attention`` so the CPU path is reasonably fast:
decode sorts the sequences by length and makes one batched SDPA call per group
of similar lengths over their gathered pages; prefill attends the sequences
with one new token the same way and loops over the others.
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


# A decode batch is attended in groups of sequences of similar length, each padded to its
# longest. Sorted by length, a sequence joins the current group while the group's padding
# stays within _RAGGED_PADDING_FACTOR * _GROUP_COST_TOKENS tokens: one more group (a gather
# and an SDPA call) costs about as much as gathering and attending that many padding
# tokens. A factor of 0 attends each sequence alone (unless lengths are equal).
_GROUP_COST_TOKENS = 256
_RAGGED_PADDING_FACTOR = 1.0


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, S, H, D], pages [..., n] -> [..., n*S, H, D] (tokens in order).

    ``index_select`` copies whole pages (one contiguous block each, whatever the page
    stride): about twice as fast as advanced indexing.
    """
    g = cache.index_select(0, pages.reshape(-1))
    return g.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:])


def _sequence_kv(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached tokens, head-major: [Hkv, length, D]."""
    pages = table_row[: -(-length // cache.shape[1])].long()
    return _gather_pages(cache, pages)[:length].transpose(0, 1)


def _length_groups(lens: list[int]) -> list[list[int]]:
    """Rows of non-zero length, longest first, cut into groups of similar length."""
    order = sorted((b for b, n in enumerate(lens) if n > 0), key=lens.__getitem__, reverse=True)
    budget = _RAGGED_PADDING_FACTOR * _GROUP_COST_TOKENS
    groups: list[list[int]] = []
    longest = waste = 0
    for b in order:
        if groups and waste + longest - lens[b] <= budget:
            groups[-1].append(b)
            waste += longest - lens[b]
        else:
            groups.append([b])
            longest, waste = lens[b], 0
    return groups


def _decode_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    lens: list[int], sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    """q [g, Hq, D] over its rows' pages (page_table [g, >=n]), each padded to the longest."""
    g, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    longest, shortest = max(lens), min(lens)
    # Entries past a row's last page may be padding (-1 or stale): clamp to a real page,
    # its tokens are masked out below.
    pages = page_table[:, : -(-longest // page_size)].long().clamp_(0, num_pages - 1)
    k = _gather_pages(k_cache, pages)[:, :longest].transpose(1, 2)  # [g, Hkv, L, D]
    v = _gather_pages(v_cache, pages)[:, :longest].transpose(1, 2)
    mask = None
    if shortest < longest:
        key_len = torch.tensor(lens, device=q.device)[:, None, None, None]
        mask = torch.arange(longest, device=q.device) < key_len  # [g, 1, 1, L]
    # The q heads sharing a kv head become that head's query rows: SDPA then reads each
    # K/V once instead of once per q head (about half the time of enable_gqa here).
    out = F.scaled_dot_product_attention(q.view(g, hkv, hq // hkv, d), k, v, attn_mask=mask,
                                         scale=sm_scale)
    return out.view(g, hq, d)


def _decode_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    lens: list[int], sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    """Row b of q [B, Hq, D] attends to its lens[b] cached tokens; length 0 gives zeros."""
    groups = _length_groups(lens)
    if len(groups) == 1 and len(groups[0]) == len(lens):  # every row in one group, as is
        return _decode_group(q, k_cache, v_cache, page_table, lens, sm_scale)
    out = torch.zeros_like(q)
    for rows in groups:
        index = torch.tensor(rows, device=q.device)
        o = _decode_group(q.index_select(0, index), k_cache, v_cache,
                          page_table.index_select(0, index), [lens[b] for b in rows], sm_scale)
        out.index_copy_(0, index, o)
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
    return _decode_rows(q, k_cache, v_cache, page_table, seq_lens.tolist(), sm_scale)


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
    singles: list[int] = []  # sequences with one new token: attended together, as in decode
    for b, ctx in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len > ctx:
            raise ValueError(f"cu_q_lens: sequence {b} has {q_len} new tokens > seq_lens {ctx}")
        if q_len == 1:
            singles.append(b)
    if len(singles) > 1:
        q_rows = torch.tensor([cu[b] for b in singles], device=q.device)
        table = page_table.index_select(0, torch.tensor(singles, device=q.device))
        o = _decode_rows(q.index_select(0, q_rows), k_cache, v_cache, table,
                         [lens[b] for b in singles], sm_scale)
        out.index_copy_(0, q_rows, o)
    else:
        singles = []
    for b, ctx in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0 or (singles and q_len == 1):
            continue
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
