"""Tiny random Hugging Face checkpoints made with transformers (test-time only dependency)."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # transformers' default init (std 0.02) gives near-zero logits; scale weights so the
    # logits are O(1) and a parity tolerance of 1e-4 actually discriminates.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def make_hf_checkpoint(directory: Path, arch: str, seed: int = 0, **overrides) -> Path:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    shard = overrides.pop("max_shard_size", None)
    config = config_cls(**{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model, seed)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return directory
