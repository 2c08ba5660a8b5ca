"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import torch

from pdengine.runtime.sequence import Sequence

_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def sample(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[dict[int, float] | None] | None]:
    """One token per row of `logits [B, vocab]` (fp32) for `seqs[b]`.

    temperature == 0 is greedy (argmax). Otherwise the logits are divided by
    the temperature, cut to top-k and to the top-p nucleus, and drawn from with
    the request's own generator when it has a seed. Logprobs (when asked) are
    those of the model's distribution before temperature and cuts: the chosen
    token's plus the top `params.logprobs`.
    """
    greedy = logits.argmax(dim=-1)
    tokens: list[int] = greedy.tolist()
    for b, seq in enumerate(seqs):
        p = seq.params
        if p.temperature == 0.0:
            continue
        # Shift by the max and keep the divisor a normal fp32 number: a tiny temperature then
        # saturates to -inf (argmax-like) instead of inf - inf = NaN in the softmax.
        row = (logits[b] - logits[b].max()) / max(p.temperature, _MIN_TEMPERATURE)
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            probs = _nucleus(probs, p.top_p)
        tokens[b] = int(torch.multinomial(probs, 1, generator=seq.rng(logits.device)).item())
    if all(seq.params.logprobs is None for seq in seqs):
        return tokens, None
    return tokens, _logprobs(logits, seqs, tokens)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before >= top_p
    drop[..., 0] = False  # the most likely token stays even if top_p rounds to 0 in fp32
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> list[dict[int, float] | None]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    out: list[dict[int, float] | None] = []
    for b, seq in enumerate(seqs):
        n = seq.params.logprobs
        if n is None:
            out.append(None)
            continue
        entry = {tokens[b]: float(logp[b, tokens[b]])}
        if n > 0:
            top = torch.topk(logp[b], n)
            entry.update(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out.append(entry)
    return out
