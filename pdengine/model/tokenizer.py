"""Tokenizer wrapper: encode/decode, streaming detokenisation and the checkpoint's chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdengine.model.errors import CheckpointFileMissingError, ModelLoadError
from pdengine.types import InvalidRequestError

_INCOMPLETE = "\ufffd"  # what a decoder yields for a cut-off multi-byte character


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, settings: dict[str, Any],
                 chat_template: str | None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))

    @classmethod
    def load(cls, checkpoint: str | Path) -> Tokenizer:
        checkpoint = Path(checkpoint)
        path = checkpoint / "tokenizer.json"
        if not path.is_file():
            raise CheckpointFileMissingError(path, "the tokenizer")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust error type is not importable
            raise ModelLoadError(f"{path}: cannot be read as a tokenizer ({exc})") from exc
        settings_path = checkpoint / "tokenizer_config.json"
        settings: dict[str, Any] = {}
        if settings_path.is_file():
            try:
                settings = json.loads(settings_path.read_text())
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"{settings_path}: not valid JSON ({exc})") from exc
        return cls(tok, settings, _chat_template(checkpoint, settings))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **extra: Any) -> str | list[int]:
        """Render `messages` with the checkpoint's template; raises InvalidRequestError."""
        if self.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template")
        try:
            text = self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError("messages", f"chat template failed: {exc}") from exc
        # The template writes the special tokens itself: encode without adding more.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                                  indent=indent)
        return env.from_string(self.chat_template or "")


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas for streaming.

    Decoding tokens one at a time is wrong for byte-level vocabularies (a UTF-8
    character can span tokens) and for tokenizers that merge spaces. Each step
    decodes a short window starting a few tokens back, emits only the text past
    what was already emitted, and holds back a trailing incomplete character
    (for at most 4 tokens: longer runs are invalid bytes, emitted as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids)
        self._window_start = max(len(self.token_ids) - 5, 0)  # context for the decoder
        self._emitted_upto = len(self.token_ids)  # tokens whose text is already out
        self.text = ""  # text of the generated tokens emitted so far

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text they complete (may be "")."""
        self.token_ids.extend(token_ids)
        decode = self._tokenizer.decode
        before = decode(self.token_ids[self._window_start:self._emitted_upto], self._skip)
        after = decode(self.token_ids[self._window_start:], self._skip)
        held = len(self.token_ids) - self._emitted_upto
        # A UTF-8 character spans at most 4 tokens; past that the bytes are simply invalid.
        if len(after) <= len(before) or (after.endswith(_INCOMPLETE) and held < 4):
            return ""
        delta = after[len(before):]
        self._window_start, self._emitted_upto = self._emitted_upto, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back, incomplete or not."""
        decode = self._tokenizer.decode
        before = decode(self.token_ids[self._window_start:self._emitted_upto], self._skip)
        after = decode(self.token_ids[self._window_start:], self._skip)
        delta = after[len(before):] if len(after) > len(before) else ""
        self._window_start = self._emitted_upto = len(self.token_ids)
        self.text += delta
        return delta


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(checkpoint: Path, settings: dict[str, Any]) -> str | None:
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template is None and (checkpoint / "chat_template.jinja").is_file():
        template = (checkpoint / "chat_template.jinja").read_text()
    return template
