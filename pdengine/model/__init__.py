"""Model runtime: HF-format checkpoints (Llama, Qwen2, Qwen3) run over a paged KV pool.

    model, tokenizer = load_model("tiny")          # or a checkpoint directory
    logits = model.forward(batch, kv_pool)         # [B, vocab] float32
"""

from pdengine.model.config import ModelConfig, RopeScaling
from pdengine.model.errors import (
    CheckpointFileMissingError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from pdengine.model.factory import load_model, resolve_model
from pdengine.model.forward_batch import ForwardBatch
from pdengine.model.model import Model
from pdengine.model.tiny import ensure_tiny_checkpoint
from pdengine.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "CheckpointFileMissingError",
    "ForwardBatch",
    "IncrementalDetokenizer",
    "Model",
    "ModelConfig",
    "ModelLoadError",
    "ModelNotFoundError",
    "RopeScaling",
    "Tokenizer",
    "UnsupportedArchitectureError",
    "ensure_tiny_checkpoint",
    "load_model",
    "resolve_model",
]
