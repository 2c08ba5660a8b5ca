"""Attention kernels over the paged KV pool: Triton on CUDA, torch twins on CPU.

Public API (dispatching per ``dispatch.active_backend()``):

- ``store_kv(k, v, k_cache, v_cache, slot_mapping)``
- ``paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale,
  num_kv_splits=None, max_seq_len=None) -> out`` (``max_seq_len``: optional host-side
  bound for the split chooser, saves a device sync)
- ``paged_prefill_attention(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens,
  sm_scale, max_q_len=None) -> out``
- ``choose_num_kv_splits(batch, num_q_heads, num_kv_heads, max_seq_len, num_sms)``

``k_cache``/``v_cache`` are per-layer views ``pool[:, layer, 0]`` / ``pool[:, layer, 1]``
of shape ``[num_pages, page_size, Hkv, D]`` with arbitrary page strides.
"""

from pdengine.kernels.chooser import choose_num_kv_splits
from pdengine.kernels.dispatch import (
    BACKENDS,
    active_backend,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
    use_backend,
)

__all__ = [
    "BACKENDS",
    "active_backend",
    "choose_num_kv_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
    "use_backend",
]
