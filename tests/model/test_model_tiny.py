"""The built-in tiny checkpoint: deterministic, atomic, loadable by us and by transformers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from model_paging import greedy_generate

from pdengine.model import Model, Tokenizer, ensure_tiny_checkpoint, load_model, resolve_model
from pdengine.model.tiny import TINY_VERSION

PROMPTS = ["Hello", "The quick brown fox jumps over", "a", "Once upon a time, in a land far away"]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_two_builds_are_byte_identical(tiny_checkpoint, tmp_path):
    again = ensure_tiny_checkpoint(tmp_path)
    assert again != tiny_checkpoint and again.name == f"tiny-{TINY_VERSION}"
    assert set(_files(again)) >= {"config.json", "model.safetensors", "tokenizer.json",
                                  "tokenizer_config.json"}
    assert _files(again) == _files(tiny_checkpoint)


def test_build_is_atomic_and_reused(tmp_path):
    path = ensure_tiny_checkpoint(tmp_path)
    marker = path / "config.json"
    stamp = marker.stat().st_mtime_ns
    assert ensure_tiny_checkpoint(tmp_path) == path and marker.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging dir left behind


def test_concurrent_builds_agree(tmp_path):
    """Two workers starting at once: one rename wins, the other uses the winner's copy."""
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: ensure_tiny_checkpoint(tmp_path), range(2)))
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    Model.load(paths[0])


def test_cache_dir_env_and_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("PDENGINE_CACHE_DIR", str(tmp_path))
    assert resolve_model("tiny") == tmp_path / f"tiny-{TINY_VERSION}"
    model, tokenizer = load_model("tiny")
    assert model.config.architecture == "LlamaForCausalLM"
    assert model.config.vocab_size == tokenizer.vocab_size


def test_tiny_config(tiny_checkpoint):
    cfg = Model.load(tiny_checkpoint).config
    assert cfg.num_kv_heads < cfg.num_heads  # GQA
    assert cfg.eos_token_ids == (Tokenizer.load(tiny_checkpoint).eos_token_id,)


def test_greedy_output_depends_on_the_prompt(tiny_checkpoint):
    model, tok = Model.load(tiny_checkpoint), Tokenizer.load(tiny_checkpoint)
    outs = greedy_generate(model, [tok.encode(p) for p in PROMPTS], 24, eos_token_id=None)
    assert len({tuple(o) for o in outs}) == len(PROMPTS)
    assert all(len(set(o)) >= 4 for o in outs), outs


def test_greedy_matches_transformers_generate(tiny_checkpoint):
    """Our model in a minimal paged loop (all prompts at once) vs HF generate, 40 tokens."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    tok = Tokenizer.load(tiny_checkpoint)
    prompts = [tok.encode(p) for p in PROMPTS]
    ours = greedy_generate(Model.load(tiny_checkpoint), prompts, 40, tok.eos_token_id)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                              max_new_tokens=40, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        assert got == ref[0, len(prompt):].tolist()
    assert min(len(o) for o in ours) >= 32
