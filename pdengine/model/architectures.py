"""Registry of supported architectures: how each one's config maps onto the decoder's flags.

One decoder implementation serves every entry; an architecture differs only in
which optional pieces (projection biases, per-head q/k norm) it switches on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchFlags:
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool


def _llama(raw: Mapping[str, Any]) -> ArchFlags:
    bias = bool(raw.get("attention_bias", False))
    return ArchFlags(bias, bias, bool(raw.get("mlp_bias", False)), qk_norm=False)


def _qwen2(raw: Mapping[str, Any]) -> ArchFlags:
    # Qwen2 always carries q/k/v biases and never an o_proj or MLP bias.
    return ArchFlags(qkv_bias=True, o_proj_bias=False, mlp_bias=False, qk_norm=False)


def _qwen3(raw: Mapping[str, Any]) -> ArchFlags:
    bias = bool(raw.get("attention_bias", False))
    return ArchFlags(bias, bias, mlp_bias=False, qk_norm=True)


ARCHITECTURES: dict[str, Callable[[Mapping[str, Any]], ArchFlags]] = {
    "LlamaForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)
