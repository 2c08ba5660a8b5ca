"""How many KV splits a decode launch uses (DESIGN.md §1.6).

Split-KV decode runs ``batch * num_kv_heads * splits`` programs (CTAs): each
split attends to a contiguous slice of the context and writes a partial output
plus its log-sum-exp; a merge kernel combines them. More splits fill more SMs
for small batches with long contexts, at the cost of a merge and of partial
buffers. The formula::

    base    = batch * num_kv_heads                       # CTAs with no split
    wanted  = ceil(CTAS_PER_SM * num_sms / base)         # splits to fill the SMs
    by_len  = max(1, max_seq_len // MIN_SPLIT_TOKENS)    # every split >= MIN_SPLIT_TOKENS
    splits  = clamp(wanted, 1, min(by_len, MAX_SPLITS))

Properties (tested in tests/kernels/test_kernels_chooser.py):
- never more splits than KV blocks of ``BLOCK_N`` tokens, and no split shorter
  than ``MIN_SPLIT_TOKENS`` (sequences shorter than 2*MIN_SPLIT_TOKENS get 1);
- for batch 1 the count grows (never shrinks) with the context length until the
  SMs are filled or ``MAX_SPLITS`` is reached;
- a batch that already fills the SMs is not split;
- always within ``[1, MAX_SPLITS]``.

The count only changes performance: the kernels give the same result for any
split count (the split-invariance tests check this).
"""

from __future__ import annotations

BLOCK_N = 64  # KV tile of the decode kernel
MIN_SPLIT_TOKENS = 256  # shortest worthwhile split: 4 tiles of work per CTA
CTAS_PER_SM = 2  # aim for two resident CTAs per SM to hide load latency
MAX_SPLITS = 64  # bounds the partial buffers and the merge's work


def choose_num_kv_splits(
    batch: int, num_q_heads: int, num_kv_heads: int, max_seq_len: int, num_sms: int
) -> int:
    """Return the number of KV splits for a decode launch (formula in the module doc).

    ``num_q_heads`` is taken for validation: the decode kernel runs one program per
    KV head and processes that head's whole GQA group, so CTAs scale with Hkv.
    """
    for name, value in (
        ("batch", batch),
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("num_sms", num_sms),
    ):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len: must be >= 0, got {max_seq_len}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: {num_q_heads} not a multiple of {num_kv_heads}")
    base = batch * num_kv_heads
    wanted = -(-(CTAS_PER_SM * num_sms) // base)
    by_len = max(1, max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_len, MAX_SPLITS))
