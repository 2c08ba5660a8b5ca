"""Scheduler: which sequences run in the next forward step, and what their results mean.

Plain-Python planning over a `PageAllocator`. One step holds
- a decode token for every decoding sequence (continuous batching; a new page
  is taken when a sequence crosses a page boundary), then
- prefill chunks filling at most `chunk_tokens` prompt tokens: running
  prefills continue first, then waiting sequences are admitted in arrival
  order (FCFS, no overtaking) while their pages and a batch slot are free.
  A waiting sequence gets the pages for all its known tokens on admission,
  so a chunked prefill never stalls half way.
When a decode token finds no free page the newest running sequence is
preempted (pages freed, requeued at the front, recomputed later). A request
that could never fit (its prompt plus max_tokens exceed the pool or
max_model_len) is refused when added.

Prefill-only mode (the PD prefill worker): a sequence whose prompt is
computed and whose first token is sampled leaves the scheduler as
PREFILLED, its pages now owned by the caller (`release` frees them). Every
prefill chunk reports which of the sequence's pages it completed.
The decode worker enters sequences with `add_prefilled`.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdengine.cache import PageAllocator, PageTable
from pdengine.config import SchedulerConfig
from pdengine.runtime.sequence import SeqStatus, Sequence
from pdengine.types import InvalidRequestError, PromptTooLongError


class ScheduledSeq:
    """`num_tokens` of `seq` from position `start` run in this step."""

    __slots__ = ("end", "num_tokens", "samples", "seq", "start")

    def __init__(self, seq: Sequence, start: int, num_tokens: int) -> None:
        self.seq = seq
        self.start = start
        self.num_tokens = num_tokens
        self.end = start + num_tokens
        # The step computes the sequence's last known token, so its logits are sampled.
        self.samples = self.end == len(seq.token_ids)

    def __repr__(self) -> str:
        return f"ScheduledSeq({self.seq.request_id!r}, start={self.start}, n={self.num_tokens})"


@dataclass
class ScheduledStep:
    items: list[ScheduledSeq]
    is_decode: bool  # every item is a decoding sequence's one new token

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


@dataclass
class ChunkProgress:
    """Pages a prefill chunk completed: `page_indices` index the sequence's page table."""

    seq: Sequence
    start: int
    end: int
    page_indices: list[int]
    pages: list[int]
    is_last: bool


@dataclass
class StepOutput:
    sampled: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    prefilled: list[Sequence] = field(default_factory=list)  # prefill-only hand-offs
    chunks: list[ChunkProgress] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        eos_token_ids: Iterable[int] = (),
        *,
        prefill_only: bool = False,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_only = prefill_only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival: the last one is preempted first
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # ---- entering -------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse (typed) a request that could never be served with this pool and model length."""
        if prompt_len < 1:
            raise InvalidRequestError("prompt", "must contain at least one token")
        cfg = self.config
        pool_tokens = self.allocator.num_pages * cfg.page_size
        need = prompt_len if self.prefill_only else prompt_len + max_tokens
        if prompt_len > min(cfg.max_model_len, pool_tokens):
            raise PromptTooLongError(prompt_len, min(cfg.max_model_len, pool_tokens))
        if need > cfg.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len {cfg.max_model_len}",
            )
        if need > pool_tokens:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the KV pool "
                f"({pool_tokens} tokens)",
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        seq.arrival = next(self._arrivals)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, pages: list[int], first_token: int) -> StepOutput:
        """Decode side: the prompt's K/V already sits in `pages` (owned by the scheduler from now).

        The first token (sampled by the prefill side) is appended; it may finish the
        sequence at once, which the returned StepOutput reports.
        """
        self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        table = PageTable(self.config.page_size, pages)
        if table.capacity < seq.num_prompt_tokens:
            raise ValueError(f"{len(pages)} pages cannot hold {seq.num_prompt_tokens} tokens")
        seq.arrival = next(self._arrivals)
        seq.page_table = table
        seq.num_computed = seq.num_prompt_tokens
        seq.status = SeqStatus.DECODING
        bisect.insort(self.running, seq, key=_arrival)
        out = StepOutput()
        self._accept_token(seq, first_token, None, out)
        return out

    # ---- planning -------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> ScheduledStep | None:
        preempted_before = self.num_preemptions
        items = self._schedule_decodes()
        # Pages just freed by a preemption go to the decodes that needed them, not to admissions.
        num_decodes = len(items)
        items += self._schedule_prefills(admit=self.num_preemptions == preempted_before)
        return ScheduledStep(items, is_decode=len(items) == num_decodes) if items else None

    def _schedule_decodes(self) -> list[ScheduledSeq]:
        items: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.status is not SeqStatus.DECODING:
                i += 1
                continue
            table = seq.page_table
            assert table is not None
            while seq.num_computed >= table.capacity and not table.grow(
                seq.num_computed + 1, self.allocator
            ):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                items.append(ScheduledSeq(seq, seq.num_computed, 1))
                i += 1
        return items

    def _schedule_prefills(self, admit: bool) -> list[ScheduledSeq]:
        budget = self.config.chunk_tokens
        items: list[ScheduledSeq] = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status is SeqStatus.PREFILLING:
                n = min(seq.num_pending, budget)
                items.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            table = PageTable(self.config.page_size)
            if not table.grow(len(seq.token_ids), self.allocator):
                break
            self.waiting.popleft()
            seq.page_table = table
            seq.status = SeqStatus.PREFILLING
            bisect.insort(self.running, seq, key=_arrival)
            n = min(seq.num_pending, budget)
            items.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return items

    def _preempt(self, seq: Sequence) -> None:
        """Free the pages, requeue in arrival order, recompute every known token later."""
        self.running.remove(seq)
        assert seq.page_table is not None
        seq.page_table.release(self.allocator)
        seq.page_table = None
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        pos = 0
        while pos < len(self.waiting) and self.waiting[pos].arrival < seq.arrival:
            pos += 1
        self.waiting.insert(pos, seq)

    # ---- results --------------------------------------------------------------------------

    def update(
        self,
        step: ScheduledStep,
        tokens: list[int],
        logprobs: list[dict[int, float] | None] | None = None,
    ) -> StepOutput:
        """Apply one step's sampled tokens (one per item, ignored where the item does not sample)."""
        out = StepOutput()
        for k, item in enumerate(step.items):
            seq = item.seq
            if seq.status not in (SeqStatus.PREFILLING, SeqStatus.DECODING):
                continue  # aborted while the step ran
            was_prefilling = seq.status is SeqStatus.PREFILLING
            seq.num_computed = item.end
            if was_prefilling:
                out.chunks.append(self._chunk_progress(item))
            if not item.samples:
                continue
            lp = logprobs[k] if logprobs is not None else None
            if self.prefill_only and was_prefilling:
                seq.token_ids.append(tokens[k])
                if seq.logprobs is not None and lp is not None:
                    seq.logprobs.append(lp)
                seq.status = SeqStatus.PREFILLED
                self.running.remove(seq)
                out.sampled.append((seq, tokens[k]))
                out.prefilled.append(seq)
                continue
            seq.status = SeqStatus.DECODING
            self._accept_token(seq, tokens[k], lp, out)
        return out

    def _accept_token(
        self, seq: Sequence, token: int, lp: dict[int, float] | None, out: StepOutput
    ) -> None:
        seq.token_ids.append(token)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        if seq.output_text is not None:
            seq.output_text.push(token)
        out.sampled.append((seq, token))
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.finish(seq, reason)
            out.finished.append(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.output_text is not None and seq.output_text.stopped:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _chunk_progress(self, item: ScheduledSeq) -> ChunkProgress:
        seq, ps = item.seq, self.config.page_size
        is_last = item.end >= seq.num_prompt_tokens
        last_page = -(-item.end // ps) if is_last else item.end // ps
        first_page = item.start // ps
        indices = list(range(first_page, last_page))
        assert seq.page_table is not None
        pages = [seq.page_table.pages[i] for i in indices]
        return ChunkProgress(seq, item.start, item.end, indices, pages, is_last)

    # ---- leaving --------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: str) -> None:
        """Make `seq` terminal wherever it is and free its pages (idempotent)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        if seq.page_table is not None:
            seq.page_table.release(self.allocator)
            seq.page_table = None
        if seq.output_text is not None and reason != "abort":
            seq.output_text.finish()
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def release(self, seq: Sequence) -> None:
        """Prefill-only: the caller is done with a PREFILLED sequence's pages."""
        self.finish(seq, seq.finish_reason or "prefilled")

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
            **self.allocator.stats(),
        }


def _arrival(seq: Sequence) -> int:
    return seq.arrival
