"""EngineCore: one worker's model, KV pool, scheduler and runner behind a synchronous `step()`.

nano-vllm style: the step is schedule -> forward + sample -> update. The
owner (the colocated engine, or a PD prefill/decode worker) calls `step()`
from its compute thread, one at a time, and changes the scheduler (add,
abort, release) only between steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pdengine.cache import KVPool
from pdengine.config import SchedulerConfig
from pdengine.model import Model, Tokenizer, load_model
from pdengine.runtime.model_runner import ModelRunner
from pdengine.runtime.scheduler import ScheduledStep, Scheduler, StepOutput


class EngineCore:
    def __init__(
        self,
        model: Model,
        config: SchedulerConfig,
        *,
        device: str = "cpu",
        eos_token_ids: Iterable[int] | None = None,
        prefill_only: bool = False,
    ) -> None:
        max_len = min(config.max_model_len, model.config.max_position_embeddings)
        if max_len != config.max_model_len:
            config = SchedulerConfig(**{**config.__dict__, "max_model_len": max_len})
        self.config = config
        self.model = model
        self.pool = KVPool(model.kv_layout(config.num_pages, config.page_size), device)
        eos = model.config.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.scheduler = Scheduler(config, self.pool.allocator, eos, prefill_only=prefill_only)
        self.runner = ModelRunner(model, self.pool)

    @classmethod
    def load(
        cls,
        model: str | Path,
        config: SchedulerConfig,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        prefill_only: bool = False,
    ) -> tuple[EngineCore, Tokenizer]:
        """Load "tiny" or a checkpoint directory (slow: call it off the event loop)."""
        loaded, tokenizer = load_model(model, dtype=dtype, device=device)
        return cls(loaded, config, device=device, prefill_only=prefill_only), tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def step(self) -> tuple[ScheduledStep, StepOutput] | None:
        """Plan and run one step; None when nothing can run (idle, or waiting on pages)."""
        step = self.scheduler.schedule()
        if step is None:
            return None
        tokens, logprobs = self.runner.step(step)
        return step, self.scheduler.update(step, tokens, logprobs)
