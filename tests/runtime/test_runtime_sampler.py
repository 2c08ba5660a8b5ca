"""Sampling rules on hand-made logits."""

from __future__ import annotations

import torch

from pdengine.runtime import Sequence, sample
from pdengine.types import SamplingParams


def seqs(n: int, **kw) -> list[Sequence]:
    return [Sequence(f"s{i}", [1], SamplingParams(**kw)) for i in range(n)]


LOGITS = torch.tensor([[0.0, 3.0, 2.9, 1.0, -5.0, 2.0]])


def draws(params: dict, n: int = 400) -> set[int]:
    seq = seqs(1, seed=0, **params)[0]
    return {sample(LOGITS, [seq])[0][0] for _ in range(n)}


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample(logits, seqs(5, temperature=0.0))
    assert tokens == logits.argmax(-1).tolist() and lps is None


def test_top_k_and_top_p_restrict_the_support():
    assert draws({"temperature": 1.0, "top_k": 2}) == {1, 2}
    # softmax mass: token 1 0.407, token 2 0.368, token 5 0.150: top_p 0.7 keeps exactly {1, 2}
    assert draws({"temperature": 1.0, "top_p": 0.7}) == {1, 2}
    assert draws({"temperature": 1.0, "top_p": 0.8}) == {1, 2, 5}
    assert draws({"temperature": 1.0, "top_p": 0.3}) == {1}
    assert draws({"temperature": 1.0}) >= {0, 1, 2, 3, 5}


def test_low_temperature_concentrates_and_seed_replays():
    assert draws({"temperature": 0.01}) == {1}
    a, b = seqs(1, temperature=1.0, seed=9)[0], seqs(1, temperature=1.0, seed=9)[0]
    big = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    assert [sample(big, [a])[0][0] for _ in range(20)] == [sample(big, [b])[0][0] for _ in range(20)]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    seq = seqs(1, temperature=0.5, seed=1, logprobs=2)[0]
    tokens, lps = sample(LOGITS, [seq])
    ref = torch.log_softmax(LOGITS[0], -1)
    assert set(lps[0]) == {tokens[0], 1, 2}
    for tok, v in lps[0].items():
        assert abs(v - float(ref[tok])) < 1e-6
