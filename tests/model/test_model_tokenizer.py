"""Tokenizer wrapper on the tiny byte-level tokenizer: round trip, streaming, chat template."""

from __future__ import annotations

import pytest

from pdengine.model import CheckpointFileMissingError, Tokenizer
from pdengine.types import InvalidRequestError

TEXTS = ["hello world", "héllo wörld ✓ — 日本語 🙂", "  spaces\tand\nnewlines  ", ""]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.load(tiny_checkpoint)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # the post-processor adds BOS
    assert len(ids) == 1 + len(text.encode())  # one token per byte
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_special_tokens(tok):
    assert (tok.bos_token, tok.eos_token) == ("<|bos|>", "<|eos|>")
    assert tok.encode("<|user|>hi<|eos|>", add_special_tokens=False)[0] == tok.token_id("<|user|>")
    assert tok.decode([tok.eos_token_id, 104, 105]) == "hi"
    assert tok.decode([tok.eos_token_id, 104], skip_special_tokens=False) == "<|eos|>h"


@pytest.mark.parametrize("text", TEXTS[:3])
def test_streaming_deltas_join_to_the_text(tok, text):
    prompt = tok.encode("prompt: ")
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer(prompt)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)  # never a half character
    if any(ord(c) > 127 for c in text):
        assert "" in deltas[:-1]  # multi-byte characters were held back until complete


def test_streaming_emits_invalid_bytes_instead_of_stalling(tok):
    detok = tok.detokenizer()
    deltas = [detok.add([0xF0]) for _ in range(6)]  # lead bytes that never complete
    assert "".join(deltas).count("\ufffd") >= 2 and detok.flush().count("\ufffd") <= 4


def test_chat_template(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|bos|><|system|>be brief<|eos|><|user|>hi<|eos|><|assistant|>"
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|assistant|>")


def test_chat_template_matches_transformers(tok, tiny_checkpoint):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode("héllo") == hf("héllo")["input_ids"]


def test_chat_template_rejects_unknown_role(tok):
    with pytest.raises(InvalidRequestError, match="unknown role: robot") as err:
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    assert err.value.field == "messages"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointFileMissingError, match=r"tokenizer\.json"):
        Tokenizer.load(tmp_path)
