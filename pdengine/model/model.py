"""The causal decoder: embedding, N `DecoderLayer`s, final norm, LM head over a paged KV pool.

Lifecycle: `Model.load(path)` reads config.json and the safetensors once; the
runtime then allocates a pool of `model.kv_layout(num_pages, page_size).shape`
and calls `model.forward(batch, kv_pool)` once per scheduler step. The model
holds no per-request state: everything about sequences lives in the batch and
the pool.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from pdengine.config import KVLayout
from pdengine.model.config import ModelConfig, load_config
from pdengine.model.errors import ModelLoadError
from pdengine.model.forward_batch import ForwardBatch
from pdengine.model.layers import DecoderLayer, rms_norm
from pdengine.model.rope import Rotary
from pdengine.model.weights import TensorSource, load_tensors

# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Model:
    def __init__(self, config: ModelConfig, src: TensorSource, device: str | torch.device) -> None:
        cfg = self.config = config
        self.device = torch.device(device)
        self.embed = src.take("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = [DecoderLayer.load(src, f"model.layers.{i}", cfg)
                       for i in range(cfg.num_layers)]
        self.norm = src.take("model.norm.weight", (cfg.hidden_size,))
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
            if src.has("lm_head.weight"):
                src.take("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        else:
            self.lm_head = src.take("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        leftover = [n for n in src.unused() if not n.endswith(_IGNORED_SUFFIXES)]
        if leftover:
            raise ModelLoadError(
                f"{cfg.architecture} checkpoint has tensors the config does not explain: "
                f"{leftover[:5]}{' ...' if len(leftover) > 5 else ''}")
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(self.device)

    @classmethod
    def load(cls, path: str | Path, dtype: object | None = None,
             device: str | torch.device = "cpu") -> Model:
        """Load a checkpoint directory; `dtype` overrides the config's dtype."""
        config = load_config(Path(path), dtype=dtype)
        tensors = load_tensors(Path(path), getattr(torch, config.dtype), device)
        return cls(config, TensorSource(tensors), device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def kv_layout(self, num_pages: int, page_size: int) -> KVLayout:
        cfg = self.config
        return KVLayout(num_pages=num_pages, num_layers=cfg.num_layers, page_size=page_size,
                        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        """Run one step; returns float32 logits [B, vocab] for each sequence's last new token."""
        cfg = self.config
        if kv_pool.dim() != 6 or kv_pool.shape[1:3] != (cfg.num_layers, 2) or \
                kv_pool.shape[4:] != (cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"kv_pool shape {tuple(kv_pool.shape)} does not match "
                             f"{self.kv_layout(kv_pool.shape[0], kv_pool.shape[3]).shape}")
        if kv_pool.dtype != self.dtype:
            raise ValueError(f"kv_pool dtype {kv_pool.dtype} differs from the model's {self.dtype}")
        hidden = F.embedding(batch.input_ids, self.embed)
        cos_sin = self.rotary.cos_sin(batch.positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, cos_sin, batch, kv_pool[:, i, 0], kv_pool[:, i, 1])
        last = rms_norm(hidden[batch.logits_indices], self.norm, cfg.rms_norm_eps)
        return F.linear(last, self.lm_head).float()

    __call__ = forward
