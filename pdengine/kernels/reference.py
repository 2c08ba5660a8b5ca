"""Torch reference twins of the Triton kernels — and the CPU serving path.

Same signatures and semantics as the Triton kernels (see ``__init__``). They
are exact (no KV splitting), vectorised over tokens and heads, and use
``scaled_dot_product_attention`` so the CPU path is reasonably fast:
decode sorts the sequences by length and makes one batched SDPA call per group
of similar lengths over their gathered pages; prefill attends the sequences
with one new token the same way and loops over the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Group:
    """Rows of q attended in one SDPA call over their pages, padded to the longest row."""

    q_rows: torch.Tensor | None  # [g] rows of q and of the output; None: every row, in order
    pages: torch.Tensor  # [g * n] int64 pool pages, n = pages of the longest row
    num_rows: int
    longest: int
    mask: torch.Tensor | None  # [g, 1, 1, longest] True where a row has a key; None: all do


def _decode_plan(
    page_table: torch.Tensor, lens: list[int], q_rows: list[int], num_q_rows: int,
    num_pages: int, page_size: int,
) -> list[_Group]:  # fmt: skip
    """Groups for rows b (q row q_rows[b] of num_q_rows) attending to their first lens[b]
    cached tokens (page_table row b)."""
    groups = _length_groups(lens)
    dev = page_table.device
    plan = []
    for rows in groups:
        if len(groups) == 1 and len(rows) == len(lens):  # every row: keep their order
            rows = list(range(len(lens)))
        row_lens = [lens[b] for b in rows]
        longest = max(row_lens)
        table = page_table.index_select(0, torch.tensor(rows, device=dev))
        # Entries past a row's last page may be padding (-1 or stale): clamp to a real page,
        # its tokens are masked out.
        pages = table[:, : -(-longest // page_size)].long().clamp_(0, num_pages - 1)
        mask = None
        if min(row_lens) < longest:
            key_len = torch.tensor(row_lens, device=dev)[:, None, None, None]
            mask = torch.arange(longest, device=dev) < key_len
        q_index = [q_rows[b] for b in rows]
        index = None if q_index == list(range(num_q_rows)) else torch.tensor(q_index, device=dev)
        plan.append(_Group(index, pages.reshape(-1), len(rows), longest, mask))
    return plan


_local = threading.local()


def _cached_plan(
    key: tuple[object, ...], page_table: torch.Tensor, build: Callable[[], list[_Group]]
) -> list[_Group]:
    """The model calls a kernel once per layer with the same batch: plan once per step.

    The plan is reused (in this thread) while ``key`` (the lengths and sizes it was built
    from) and the page table's contents are unchanged.
    """
    last = getattr(_local, "plan", None)
    if last is not None and last[0] == key and last[1].shape == page_table.shape \
            and torch.equal(last[1], page_table):
        return last[2]
    plan = build()
    _local.plan = (key, page_table.clone(), plan)
    return plan


def _attend_groups(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[_Group],
    sm_scale: float, out: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Run the plan's groups; rows no group names keep ``out``'s values (zeros if None)."""
    hkv, d = k_cache.shape[2:]
    hq = q.shape[1]
    for grp in plan:
        g = grp.num_rows
        qg = q if grp.q_rows is None else q.index_select(0, grp.q_rows)
        k = k_cache.index_select(0, grp.pages).view(g, -1, hkv, d)[:, : grp.longest]
        v = v_cache.index_select(0, grp.pages).view(g, -1, hkv, d)[:, : grp.longest]
        # The q heads sharing a kv head become that head's query rows: SDPA then reads
        # each K/V once instead of once per q head (about half the time of enable_gqa).
        o = F.scaled_dot_product_attention(
            qg.view(g, hkv, hq // hkv, d), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=grp.mask, scale=sm_scale,
        ).view(g, hq, d)
        if grp.q_rows is None:
            return o
        if out is None:
            out = torch.zeros_like(q)
        out.index_copy_(0, grp.q_rows, o)
    return torch.zeros_like(q) if out is None else out


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
    num_pages, page_size = k_cache.shape[:2]
    lens = seq_lens.tolist()

    def build() -> list[_Group]:
        rows = list(range(len(lens)))
        return _decode_plan(page_table, lens, rows, len(rows), num_pages, page_size)

    key = ("decode", num_pages, page_size, _RAGGED_PADDING_FACTOR * _GROUP_COST_TOKENS, *lens)
    plan = _cached_plan(key, page_table, build)
    return _attend_groups(q, k_cache, v_cache, plan, sm_scale, None)


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
        num_pages, page_size = k_cache.shape[:2]

        def build() -> list[_Group]:
            table = page_table.index_select(0, torch.tensor(singles, device=q.device))
            return _decode_plan(table, [lens[b] for b in singles], [cu[b] for b in singles],
                                q.shape[0], num_pages, page_size)

        key = ("prefill", num_pages, page_size, _RAGGED_PADDING_FACTOR * _GROUP_COST_TOKENS,
               *lens, *cu)
        plan = _cached_plan(key, page_table, build)
        out = _attend_groups(q, k_cache, v_cache, plan, sm_scale, out)
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
