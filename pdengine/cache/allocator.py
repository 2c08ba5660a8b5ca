"""Page allocator: plain-Python bookkeeping of which KV pages are in use.

Pages carry a reference count so several owners can share one (e.g. a
transport still reading a page the scheduler has released). A page returns to
the free list only when its count drops to zero. No torch here: the pool
tensor itself lives in `KVPool`.
"""

from __future__ import annotations

from collections import deque


class PageAllocatorError(RuntimeError):
    """A caller broke the allocator's contract (double free, unknown page)."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs: list[int] = [0] * num_pages
        self.high_water = 0
        self.total_allocs = 0
        self.total_frees = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages (refcount 1 each), or None when fewer are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.total_allocs += n
        self.high_water = max(self.high_water, self.num_used)
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            self._check_owned(p)
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; a page hits the free list at zero."""
        for p in pages:
            self._check_owned(p)
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                self.total_frees += 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _check_owned(self, p: int) -> None:
        if not 0 <= p < self.num_pages:
            raise PageAllocatorError(f"page {p} is outside the pool of {self.num_pages}")
        if self._refs[p] <= 0:
            raise PageAllocatorError(f"page {p} is not allocated")

    def check_invariants(self) -> None:
        """Raise if the free list and the refcounts disagree (used by tests and leak checks)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PageAllocatorError("a page is on the free list twice")
        for p, r in enumerate(self._refs):
            if r < 0 or (r == 0) != (p in free):
                raise PageAllocatorError(f"page {p}: refcount {r}, on free list {p in free}")

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.num_pages,
            "pages_used": self.num_used,
            "pages_free": self.num_free,
            "pages_high_water": self.high_water,
        }
