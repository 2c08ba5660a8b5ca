"""The split chooser's documented properties over a table of (batch, heads, length, SMs)."""

from __future__ import annotations

import itertools

import pytest

from pdengine.kernels.chooser import BLOCK_N, MAX_SPLITS, MIN_SPLIT_TOKENS, choose_num_kv_splits

BATCHES = [1, 2, 8, 64, 256]
HEADS = [(32, 8), (32, 32), (8, 1), (64, 8)]  # (q heads, kv heads)
LENGTHS = [1, 15, 16, 17, 100, 255, 511, 1000, 4096, 8192, 32768, 131072]
SMS = [132, 188]
TABLE = list(itertools.product(BATCHES, HEADS, LENGTHS, SMS))


@pytest.mark.parametrize("sms", SMS)
def test_bounds_and_minimum_split_length(sms):
    for batch, (hq, hkv), length, _ in TABLE:
        splits = choose_num_kv_splits(batch, hq, hkv, length, sms)
        assert 1 <= splits <= MAX_SPLITS
        kv_blocks = max(1, -(-length // BLOCK_N))
        assert splits <= kv_blocks, (batch, hq, hkv, length, splits)
        if splits > 1:  # every split gets at least the minimum slice of the context
            assert length // splits >= MIN_SPLIT_TOKENS, (batch, hkv, length, splits)


@pytest.mark.parametrize(("heads", "sms"), list(itertools.product(HEADS, SMS)))
def test_batch_one_long_context_grows_until_the_sms_are_full(heads, sms):
    hq, hkv = heads
    counts = [choose_num_kv_splits(1, hq, hkv, n, sms) for n in LENGTHS]
    assert counts == sorted(counts), f"split count shrank as the context grew: {counts}"
    longest = counts[-1]
    assert longest > 1, "a 128k context with batch 1 must be split"
    # Enough CTAs to occupy every SM, unless the cap stops it.
    assert hkv * longest >= sms or longest == MAX_SPLITS


def test_short_sequences_are_not_split():
    for batch, (hq, hkv), length, sms in TABLE:
        if length < 2 * MIN_SPLIT_TOKENS:
            assert choose_num_kv_splits(batch, hq, hkv, length, sms) == 1


def test_a_batch_that_fills_the_sms_is_not_split():
    for sms in SMS:
        for hq, hkv in HEADS:
            batch = -(-2 * sms // hkv)  # two CTAs per SM without splitting
            assert choose_num_kv_splits(batch, hq, hkv, 131072, sms) == 1


def test_more_sms_never_means_fewer_splits():
    for batch, (hq, hkv), length, _ in TABLE:
        assert choose_num_kv_splits(batch, hq, hkv, length, 188) >= choose_num_kv_splits(
            batch, hq, hkv, length, 132
        )


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 8, 8, 100, 132), "batch"),
        ((1, 8, 0, 100, 132), "num_kv_heads"),
        ((1, 6, 4, 100, 132), "num_q_heads"),
        ((1, 8, 8, -1, 132), "max_seq_len"),
        ((1, 8, 8, 100, 0), "num_sms"),
    ],
)
def test_rejects_nonsense(args, field):
    with pytest.raises(ValueError, match=field):
        choose_num_kv_splits(*args)
