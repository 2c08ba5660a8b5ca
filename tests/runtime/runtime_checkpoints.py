"""A tiny random Llama checkpoint made with transformers, plus the tiny model's byte tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

LLAMA = dict(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=256, eos_token_id=257)


def make_llama_checkpoint(directory: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """save_pretrained a random LlamaForCausalLM whose logits are O(1) (no near-ties for greedy)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, directory / name)
    return directory
