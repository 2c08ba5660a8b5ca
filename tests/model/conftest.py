"""Session-scoped tiny checkpoints for the model tests, built once per run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_checkpoints import LLAMA3_ROPE, make_hf_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # The matrices here are tiny: a second intra-op thread buys nothing, and on a loaded
    # 2-core box its spin-waiting made these tests ~40x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> checkpoint dir. Llama untied with llama3 RoPE; Qwen2 tied; Qwen3 untied."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": make_hf_checkpoint(root / "llama", "llama", seed=1, rope_parameters=LLAMA3_ROPE),
        "qwen2": make_hf_checkpoint(root / "qwen2", "qwen2", seed=2, tie_word_embeddings=True),
        "qwen3": make_hf_checkpoint(root / "qwen3", "qwen3", seed=3, attention_bias=True),
    }


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdengine.model import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))
