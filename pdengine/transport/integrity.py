"""Chunk checksums: xxh3_64 over the bytes of a chunk's pages, in page order (I7).

Sender and receiver hash the same bytes in the same order (source pages on the
sender, destination pages on the receiver), so consecutive pages are hashed as
one buffer and the result does not depend on how pages group into runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from pdengine.transport.base import page_spans


def pool_page_views(pool: Any, pages: Sequence[int]) -> list[memoryview]:
    """Byte views of ``pages`` of a pool tensor, one per run of consecutive pages.

    CPU pools give zero-copy (writable) views; CUDA pools are copied to the host.
    """
    flat = pool.view(pool.shape[0], -1)
    num_pages = flat.shape[0]
    views: list[memoryview] = []
    for start, count in page_spans(pages):
        if start < 0 or start + count > num_pages:
            raise ValueError(f"pages {start}..{start + count - 1} outside a pool of {num_pages}")
        run = flat[start : start + count]
        if run.is_cuda:
            run = run.cpu()
        views.append(memoryview(run.contiguous().view(torch.uint8).numpy()).cast("B"))
    return views


def checksum_views(views: Sequence[memoryview]) -> int:
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(view)
    return hasher.intdigest()
