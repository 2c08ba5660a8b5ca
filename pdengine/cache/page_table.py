"""Per-request page table: the pool pages holding one sequence's tokens, in order."""

from __future__ import annotations

from pdengine.cache.allocator import PageAllocator


class PageTable:
    """Token `i` of the sequence lives in slot `pages[i // page_size] * page_size + i % page_size`."""

    def __init__(self, page_size: int, pages: list[int] | None = None) -> None:
        self.page_size = page_size
        self.pages: list[int] = list(pages or [])

    @property
    def capacity(self) -> int:
        """Tokens the table's pages can hold."""
        return len(self.pages) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        """How many more pages are needed to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // self.page_size) - len(self.pages))

    def grow(self, num_tokens: int, allocator: PageAllocator) -> bool:
        """Ensure room for `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        need = self.pages_needed(num_tokens)
        if need == 0:
            return True
        got = allocator.alloc(need)
        if got is None:
            return False
        self.pages.extend(got)
        return True

    def release(self, allocator: PageAllocator) -> None:
        if self.pages:
            allocator.free(self.pages)
            self.pages = []

    def slots(self, start: int, end: int) -> list[int]:
        ps = self.page_size
        return [self.pages[i // ps] * ps + i % ps for i in range(start, end)]
