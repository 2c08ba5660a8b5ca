"""Turn a model reference ("tiny" or a checkpoint directory) into a loaded model and tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from pdengine.model.errors import ModelNotFoundError
from pdengine.model.model import Model
from pdengine.model.tiny import ensure_tiny_checkpoint
from pdengine.model.tokenizer import Tokenizer

BUILTIN_MODELS = ("tiny",)


def resolve_model(name_or_path: str | Path) -> Path:
    """"tiny" -> the built-in checkpoint (made on first use); a directory -> itself."""
    if str(name_or_path) == "tiny":
        return ensure_tiny_checkpoint()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(str(name_or_path))
    return path


def load_model(name_or_path: str | Path, dtype: object | None = None,
               device: str | torch.device = "cpu") -> tuple[Model, Tokenizer]:
    path = resolve_model(name_or_path)
    return Model.load(path, dtype=dtype, device=device), Tokenizer.load(path)
