"""Paged KV cache: the pool tensor, the page allocator and per-request page tables."""

from pdengine.cache.allocator import PageAllocator, PageAllocatorError
from pdengine.cache.page_table import PageTable
from pdengine.cache.pool import KVPool

__all__ = ["KVPool", "PageAllocator", "PageAllocatorError", "PageTable"]
