"""Parse a Hugging Face `config.json` into a frozen `ModelConfig`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdengine.model.architectures import ARCHITECTURES, ArchFlags, supported_architectures
from pdengine.model.errors import (
    CheckpointFileMissingError,
    ModelLoadError,
    UnsupportedArchitectureError,
)

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" or "llama3"."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    flags: ArchFlags
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str  # one of DTYPES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def normalize_dtype(dtype: object) -> str:
    """Accept "bf16", "bfloat16", "torch.bfloat16" or a torch.dtype; return a DTYPES name."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return name


def load_config(checkpoint: Path, dtype: object | None = None) -> ModelConfig:
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise CheckpointFileMissingError(path, "the model config")
    raw = _read_json(path)
    generation = Path(checkpoint) / "generation_config.json"
    if generation.is_file():
        # Chat models often list their end-of-turn token only here (e.g. Llama 3 Instruct).
        eos = _token_ids(raw.get("eos_token_id"))
        extra = _token_ids(_read_json(generation).get("eos_token_id"))
        raw = {**raw, "eos_token_id": [*eos, *(t for t in extra if t not in eos)]}
    return parse_config(raw, dtype=dtype)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def parse_config(raw: Mapping[str, Any], dtype: object | None = None) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else f"<none> (model_type={raw.get('model_type')!r})"
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(arch, supported_architectures())
    if raw.get("use_sliding_window"):
        raise UnsupportedArchitectureError(f"{arch} with sliding-window attention",
                                           supported_architectures())
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    rope_theta, scaling = _rope(raw)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    chosen = dtype if dtype is not None else raw.get("dtype") or raw.get("torch_dtype")
    return ModelConfig(
        architecture=arch,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=_int(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        flags=ARCHITECTURES[arch](raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        dtype=normalize_dtype(chosen or "float32"),
    )


def _int(raw: Mapping[str, Any], key: str) -> int:
    if key not in raw:
        raise ModelLoadError(f"config.json lacks {key!r}")
    return int(raw[key])


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); older files use
    # `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")
