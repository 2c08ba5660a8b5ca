"""Frozen configuration shared by every layer (stdlib only).

`KVLayout` is the one page-layout contract between the cache, the kernels and
the transport: a pool tensor of shape
``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` where one page
holds every layer's K and V for its tokens contiguously, so a run of
consecutive pages is a single transfer descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVLayout:
    num_pages: int
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"  # torch dtype name: float32 | float16 | bfloat16

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.num_pages,
            self.num_layers,
            2,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page (all layers, K and V)."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclass(frozen=True)
class Deadlines:
    """Seconds a room may spend in each non-terminal state (DESIGN.md I2)."""

    bootstrap_s: float = 30.0
    waiting_for_input_s: float = 60.0
    transfer_progress_s: float = 30.0
    drain_s: float = 10.0

    def total_s(self) -> float:
        return self.bootstrap_s + self.waiting_for_input_s + self.transfer_progress_s


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    num_pages: int = 1024
    max_batch_size: int = 64
    chunk_tokens: int = 256  # chunked-prefill token budget per step
    max_model_len: int = 4096


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    cluster_token: str = ""
    api_key: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    extra: dict[str, str] = field(default_factory=dict)
