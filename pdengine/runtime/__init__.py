"""Runtime: sequences, the scheduler (chunked prefill, continuous batching, preemption),
the model runner (ForwardBatch building) and sampling. Reused by the colocated engine
and by the PD prefill/decode workers."""

from pdengine.runtime.core import EngineCore
from pdengine.runtime.detokenize import OutputText
from pdengine.runtime.model_runner import ForwardModel, ModelRunner
from pdengine.runtime.sampler import sample
from pdengine.runtime.scheduler import (
    ChunkProgress,
    ScheduledSeq,
    ScheduledStep,
    Scheduler,
    StepOutput,
)
from pdengine.runtime.sequence import SeqStatus, Sequence

__all__ = [
    "ChunkProgress",
    "EngineCore",
    "ForwardModel",
    "ModelRunner",
    "OutputText",
    "ScheduledSeq",
    "ScheduledStep",
    "Scheduler",
    "SeqStatus",
    "Sequence",
    "StepOutput",
    "sample",
]
