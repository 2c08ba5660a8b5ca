"""KVPool: the one owner of the paged KV tensor.

Shape `KVLayout.shape = [num_pages, num_layers, 2, page_size, num_kv_heads,
head_dim]`: one page holds every layer's K and V for its tokens contiguously,
so a run of consecutive pages is one transfer descriptor. Kernels take the
per-layer views below, whose page stride is *not* contiguous.
"""

from __future__ import annotations

import torch

from pdengine.cache.allocator import PageAllocator
from pdengine.config import KVLayout


class KVPool:
    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.tensor = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype), device=self.device)
        self.allocator = PageAllocator(layout.num_pages)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer, each [num_pages, page_size, num_kv_heads, head_dim]."""
        return self.tensor[:, index, 0], self.tensor[:, index, 1]

    def page_bytes(self, page: int) -> torch.Tensor:
        """The raw bytes of one page (all layers, K and V): a contiguous uint8 view."""
        return self.tensor[page].view(torch.uint8).reshape(-1)

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
