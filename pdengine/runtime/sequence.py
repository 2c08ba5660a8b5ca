"""Sequence: one request's scheduling state (plain Python, no tensors but its RNG)."""

from __future__ import annotations

import enum

import torch

from pdengine.cache import PageTable
from pdengine.runtime.detokenize import OutputText
from pdengine.types import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages
    PREFILLING = "prefilling"  # running; some of its known tokens are not in the KV cache yet
    DECODING = "decoding"  # running; one new token per step
    PREFILLED = "prefilled"  # prefill-only mode: prompt computed, pages handed to the caller
    FINISHED = "finished"  # terminal; pages released


class Sequence:
    """`token_ids` = prompt + outputs; `num_computed` of them have K/V in the pool.

    The sequence is prefilling while more than one known token lacks K/V, and
    decoding when exactly the last sampled token does. A preempted sequence
    drops its pages and recomputes every known token, then samples on.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_text: OutputText | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.output_text = output_text
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.page_table: PageTable | None = None
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        self.arrival = -1  # set by the scheduler; older sequences win pages
        self.num_preemptions = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Known tokens whose K/V is not in the pool yet."""
        return len(self.token_ids) - self.num_computed

    @property
    def text(self) -> str:
        return self.output_text.text if self.output_text is not None else ""

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def rng(self, device: torch.device) -> torch.Generator | None:
        """Per-request generator when a seed is set (reproducible whatever the batch)."""
        if self.params.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed)
        return self.generator

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed})"
        )
