"""Checkpoints for the runtime tests: the built-in tiny model and a transformers-made Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_checkpoints import make_llama_checkpoint


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdengine.model import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("pdengine-cache"))


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("hf-llama"), tiny_path, seed=7)
