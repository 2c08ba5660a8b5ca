"""Typed errors raised while resolving or loading a checkpoint."""

from __future__ import annotations

from pathlib import Path

from pdengine.types import PDEngineError, UnknownModelError


class ModelLoadError(PDEngineError, ValueError):
    """A checkpoint exists but cannot be loaded (bad config, wrong tensors)."""


class UnsupportedArchitectureError(ModelLoadError):
    def __init__(self, architecture: str, supported: list[str]) -> None:
        super().__init__(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported)}"
        )
        self.architecture = architecture


class CheckpointFileMissingError(ModelLoadError):
    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"checkpoint file missing: {path} ({what})")
        self.path = path


class ModelNotFoundError(UnknownModelError, ValueError):
    """Neither a known model name nor an existing checkpoint directory."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} is neither 'tiny' nor an existing checkpoint directory")
        self.name = name
