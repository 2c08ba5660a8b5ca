"""Checkpoint loading: shards, dtypes, and clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from model_checkpoints import make_hf_checkpoint
from model_paging import PagedRunner

from pdengine.model import (
    CheckpointFileMissingError,
    Model,
    ModelLoadError,
    ModelNotFoundError,
    RopeScaling,
    UnsupportedArchitectureError,
    resolve_model,
)
from pdengine.model.config import parse_config
from pdengine.types import PDEngineError

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("sharded") / "llama", "llama", seed=7,
                              max_shard_size="40KB")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_with_parity(sharded):
    import transformers

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = Model.load(sharded)
    hf = transformers.AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert (PagedRunner(model).step({0: PROMPT})[0] - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_override_runs_in_that_dtype(hf_checkpoints, dtype):
    ref = Model.load(hf_checkpoints["qwen3"])
    model = Model.load(hf_checkpoints["qwen3"], dtype=dtype)
    assert model.dtype == getattr(torch, dtype) and model.config.dtype == dtype
    assert model.kv_layout(8, 4).dtype == dtype
    logits = PagedRunner(model).step({0: PROMPT})
    assert logits.dtype == torch.float32
    # Half precision: close to fp32 in shape, not bit-identical.
    full = PagedRunner(ref).step({0: PROMPT})
    assert (logits - full).abs().max() < 0.1 * full.abs().max()


def test_config_dtype_is_the_default(hf_checkpoints, tmp_path):
    ckpt = _copy(hf_checkpoints["llama"], tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert Model.load(ckpt).dtype == torch.bfloat16


def test_kv_layout_matches_the_config(hf_checkpoints):
    model = Model.load(hf_checkpoints["qwen2"])
    assert model.kv_layout(10, 16).shape == (10, 2, 2, 16, 2, 16)


def test_missing_config_is_a_clear_error(hf_checkpoints, tmp_path):
    ckpt = _copy(hf_checkpoints["llama"], tmp_path / "c")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointFileMissingError, match=r"config\.json") as err:
        Model.load(ckpt)
    assert isinstance(err.value, PDEngineError)


def test_missing_weights_is_a_clear_error(hf_checkpoints, tmp_path):
    ckpt = _copy(hf_checkpoints["llama"], tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileMissingError, match="safetensors"):
        Model.load(ckpt)


def test_missing_shard_is_a_clear_error(sharded, tmp_path):
    ckpt = _copy(sharded, tmp_path / "c")
    victim = sorted(ckpt.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointFileMissingError, match=re.escape(victim.name)):
        Model.load(ckpt)


def test_unsupported_architecture_is_a_clear_error(hf_checkpoints, tmp_path):
    ckpt = _copy(hf_checkpoints["llama"], tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        Model.load(ckpt)


def test_tensors_the_config_does_not_explain_are_rejected(hf_checkpoints, tmp_path):
    # A Qwen3 checkpoint (q/k norms) relabelled as Llama must not load silently.
    ckpt = _copy(hf_checkpoints["qwen3"], tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="q_norm"):
        Model.load(ckpt)


def test_wrong_tensor_shape_is_rejected(hf_checkpoints, tmp_path):
    ckpt = _copy(hf_checkpoints["llama"], tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"gate_proj.*shape"):
        Model.load(ckpt)


def test_bad_dtype_is_rejected(hf_checkpoints):
    with pytest.raises(ModelLoadError, match="int8"):
        Model.load(hf_checkpoints["llama"], dtype="int8")


def test_unknown_model_reference(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model") as err:
        resolve_model(tmp_path / "no-such-model")
    assert err.value.http_status == 404
    assert resolve_model(tmp_path) == tmp_path


def test_kv_pool_of_the_wrong_shape_is_rejected(hf_checkpoints):
    model = Model.load(hf_checkpoints["llama"])
    runner = PagedRunner(model)
    runner.pool = torch.zeros(8, 3, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="kv_pool shape"):
        runner.step({0: PROMPT})


def test_legacy_and_current_config_formats_agree():
    """transformers < 5 wrote rope_theta + rope_scaling + torch_dtype; 5.x writes rope_parameters."""
    common = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    legacy = parse_config({**common, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                           "rope_scaling": {"rope_type": "llama3", **scaling}})
    current = parse_config({**common, "dtype": "bfloat16", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert legacy == current
    assert legacy.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert legacy.num_kv_heads == 2 and legacy.head_dim == 4


@pytest.mark.parametrize(("key", "value", "message"), [
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
    ("use_sliding_window", True, "sliding-window"),
])
def test_unsupported_config_features_are_rejected(hf_checkpoints, key, value, message):
    raw = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=message):
        parse_config({**raw, key: value})


def test_generation_config_adds_end_of_turn_tokens(hf_checkpoints, tmp_path):
    ckpt = _copy(hf_checkpoints["llama"], tmp_path / "c")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert Model.load(ckpt).config.eos_token_ids == (2, 9)


def test_kv_pool_of_the_wrong_dtype_is_rejected(hf_checkpoints):
    model = Model.load(hf_checkpoints["llama"])
    runner = PagedRunner(model)
    runner.pool = runner.pool.to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_pool dtype"):
        runner.step({0: PROMPT})
