"""The built-in "tiny" model: a small random Llama checkpoint made locally, never downloaded.

`ensure_tiny_checkpoint()` writes it once into a cache directory (deterministic
from a fixed seed, so every machine gets the same bytes) and returns its path;
it then loads through the ordinary loader like any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

TINY_VERSION = "v1"  # bump whenever the recipe below changes
SEED = 20240229
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDENGINE_CACHE_DIR") or Path.home() / ".cache" / "pdengine")


def ensure_tiny_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Path of the tiny checkpoint under `cache_dir`, building it on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{TINY_VERSION}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-{TINY_VERSION}-", dir=root))
    try:
        write_tiny_checkpoint(staging)
        try:
            staging.rename(target)  # atomic: readers see all files or no directory
        except OSError:
            if not target.is_dir():  # lost a race only if the winner's copy is there
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tiny_checkpoint(directory: Path) -> None:
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2, sort_keys=True))
    save_file(_random_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    _byte_tokenizer().save(str(directory / "tokenizer.json"))
    settings = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def _random_weights() -> dict[str, torch.Tensor]:
    # Normal init, std 1/sqrt(fan_in) and unit embeddings: large enough that the output
    # depends on the context (greedy decoding does not collapse onto one token).
    c = TINY_CONFIG
    gen = torch.Generator().manual_seed(SEED)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv, vocab = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["vocab_size"]

    def normal(*shape: int, std: float | None = None) -> torch.Tensor:
        scale = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": normal(vocab, h, std=1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": torch.ones(h),
            f"{p}.self_attn.q_proj.weight": normal(q, h),
            f"{p}.self_attn.k_proj.weight": normal(kv, h),
            f"{p}.self_attn.v_proj.weight": normal(kv, h),
            f"{p}.self_attn.o_proj.weight": normal(h, q),
            f"{p}.post_attention_layernorm.weight": torch.ones(h),
            f"{p}.mlp.gate_proj.weight": normal(inter, h),
            f"{p}.mlp.up_proj.weight": normal(inter, h),
            f"{p}.mlp.down_proj.weight": normal(h, inter),
        }
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = normal(vocab, h)
    return {name: t.contiguous() for name, t in weights.items()}


def _byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte 0..255 (byte-level BPE convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _byte_tokenizer() -> Tokenizer:
    """One token per byte (ids 0..255) plus the special tokens (ids 256..)."""
    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", 256)])
    return tok
