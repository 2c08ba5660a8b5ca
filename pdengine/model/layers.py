"""One decoder layer (attention + gated MLP), parameterised by the architecture's flags.

Weights are stored fused (q|k|v and gate|up) so each layer runs four matmuls.
Attention goes through `pdengine.kernels`: the new tokens' K/V are scattered
into the paged pool, then queries attend over each sequence's paged context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdengine import kernels
from pdengine.model.config import ModelConfig
from pdengine.model.forward_batch import ForwardBatch
from pdengine.model.rope import apply_rotary
from pdengine.model.weights import TensorSource


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (the reference models' rounding)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)
    return normed.mul_(weight) if weight.dtype == normed.dtype else weight * normed


def _fuse(src: TensorSource, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
    return torch.cat([src.take(n, s) for n, s in zip(names, shapes, strict=True)], dim=0)


@dataclass
class DecoderLayer:
    cfg: ModelConfig
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None

    @classmethod
    def load(cls, src: TensorSource, prefix: str, cfg: ModelConfig) -> DecoderLayer:
        h, q, kv, inter, d = (cfg.hidden_size, cfg.q_size, cfg.kv_size,
                              cfg.intermediate_size, cfg.head_dim)
        f = cfg.flags
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        qkv = [f"{attn}.{p}_proj" for p in "qkv"]
        qkv_shapes = [(q,), (kv,), (kv,)]
        return cls(
            cfg=cfg,
            input_norm=src.take(f"{prefix}.input_layernorm.weight", (h,)),
            qkv_weight=_fuse(src, [n + ".weight" for n in qkv], [(s[0], h) for s in qkv_shapes]),
            qkv_bias=_fuse(src, [n + ".bias" for n in qkv], qkv_shapes) if f.qkv_bias else None,
            o_weight=src.take(f"{attn}.o_proj.weight", (h, q)),
            o_bias=src.take(f"{attn}.o_proj.bias", (h,)) if f.o_proj_bias else None,
            q_norm=src.take(f"{attn}.q_norm.weight", (d,)) if f.qk_norm else None,
            k_norm=src.take(f"{attn}.k_norm.weight", (d,)) if f.qk_norm else None,
            post_norm=src.take(f"{prefix}.post_attention_layernorm.weight", (h,)),
            gate_up_weight=_fuse(src, [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
                                 [(inter, h), (inter, h)]),
            gate_up_bias=_fuse(src, [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"],
                               [(inter,), (inter,)]) if f.mlp_bias else None,
            down_weight=src.take(f"{mlp}.down_proj.weight", (h, inter)),
            down_bias=src.take(f"{mlp}.down_proj.bias", (h,)) if f.mlp_bias else None,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        hidden = hidden + self._attention(
            rms_norm(hidden, self.input_norm, self.cfg.rms_norm_eps), cos_sin, batch,
            k_cache, v_cache)
        return hidden.add_(self._mlp(rms_norm(hidden, self.post_norm, self.cfg.rms_norm_eps)))

    def _attention(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
                   ) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        cos, sin = cos_sin
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = rms_norm(q.view(tokens, cfg.num_heads, cfg.head_dim), self.q_norm,
                         cfg.rms_norm_eps)
            k = rms_norm(k.view(tokens, cfg.num_kv_heads, cfg.head_dim), self.k_norm,
                         cfg.rms_norm_eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:  # q and k heads side by side in qkv: rotate them in one pass
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(tokens, -1, cfg.head_dim)
            q, k = apply_rotary(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        scale = cfg.head_dim**-0.5
        if batch.is_decode:
            out = kernels.paged_decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale,
                max_seq_len=batch.max_seq_len)
        else:
            out = kernels.paged_prefill_attention(
                q, k_cache, v_cache, batch.page_table, batch.cu_q_lens, batch.seq_lens, scale,
                max_q_len=batch.max_q_len)
        return F.linear(out.reshape(tokens, cfg.q_size), self.o_weight, self.o_bias)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate, inplace=True).mul_(up), self.down_weight, self.down_bias)
