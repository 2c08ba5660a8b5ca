"""The OpenAPI 3.1 description of the public endpoints, written as data.

Request bodies are full JSON Schemas (types, ranges, required fields), so a
schema-driven fuzzer can generate valid and invalid requests from it. Each app
serves the subset of paths it actually routes (`openapi_schema(role, paths)`).
"""

from __future__ import annotations

import copy
from typing import Any

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


_ERROR_CODES = {
    "400": "Invalid request; `error.param` names the field",
    "401": "Missing or wrong API key (when the server has one)",
    "404": "Unknown model",
    "413": "Request body over the size limit",
    "429": "Too many concurrent requests",
    "502": "The request failed in a worker (transfer, timeout, peer failure)",
}


def _errors(*codes: str) -> dict[str, Any]:
    return {c: {"description": _ERROR_CODES[c], **_json(_ref("Error"))} for c in codes}


_SAMPLING_COMMON: dict[str, Any] = {
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "description": "-1 disables", "minimum": -1, "not": {"const": 0}},
    "seed": {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "maxItems": 16,
                        "items": {"type": "string", "minLength": 1}}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": "boolean"},
}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_STREAM_OPTIONS = {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
            "max_tokens": {"type": "integer", "minimum": 1},
            "n": {"const": 1},
            "stream": {"type": "boolean"},
            "stream_options": _STREAM_OPTIONS,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "echo": {"const": False},
            "presence_penalty": {"const": 0},
            "frequency_penalty": {"const": 0},
            "user": {"type": "string"},
            **_SAMPLING_COMMON,
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_tokens": {"type": "integer", "minimum": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "n": {"const": 1},
            "stream": {"type": "boolean"},
            "stream_options": _STREAM_OPTIONS,
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "presence_penalty": {"const": 0},
            "frequency_penalty": {"const": 0},
            "user": {"type": "string"},
            **_SAMPLING_COMMON,
        },
    },
    "SamplingParams": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "max_new_tokens": {"type": "integer", "minimum": 1},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            **_SAMPLING_COMMON,
        },
    },
    "GenerateRequest": {
        "type": "object",
        "description": "Exactly one of `text` and `input_ids`. Worker roles also take "
                       "`bootstrap_room` (prefill, decode) and `bootstrap_host` (decode).",
        "properties": {
            "text": {"type": "string", "minLength": 1},
            "input_ids": _TOKEN_IDS,
            "sampling_params": _ref("SamplingParams"),
            "stream": {"type": "boolean"},
            "rid": {"type": "string", "minLength": 1, "maxLength": 128},
            "bootstrap_room": {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1},
            "bootstrap_host": {"type": "string"},
        },
    },
    "AbortRequest": {
        "type": "object",
        "properties": {
            "rid": {"type": "string", "minLength": 1},
            "bootstrap_room": {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1},
        },
    },
}

_GEN_ERRORS = ("400", "401", "404", "413", "429", "502")

PATHS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"post": {
        "summary": "OpenAI text completion (streaming with SSE when `stream` is true)",
        "requestBody": {"required": True, **_json(_ref("CompletionRequest"))},
        "responses": {"200": {"description": "Completion, or an SSE stream ending `data: [DONE]`",
                              **_json({"type": "object"})}, **_errors(*_GEN_ERRORS)}}},
    "/v1/chat/completions": {"post": {
        "summary": "OpenAI chat completion; the prompt is built with the model's chat template",
        "requestBody": {"required": True, **_json(_ref("ChatCompletionRequest"))},
        "responses": {"200": {"description": "Chat completion, or an SSE stream",
                              **_json({"type": "object"})}, **_errors(*_GEN_ERRORS)}}},
    "/v1/models": {"get": {
        "summary": "The served model",
        "responses": {"200": {"description": "Model list", **_json({"type": "object"})},
                      **_errors("401")}}},
    "/generate": {"post": {
        "summary": "SGLang-style generation (`text` or `input_ids`)",
        "requestBody": {"required": True, **_json(_ref("GenerateRequest"))},
        "responses": {"200": {"description": "Result, or an SSE stream of cumulative outputs",
                              **_json({"type": "object"})}, **_errors(*_GEN_ERRORS)}}},
    "/abort_request": {"post": {
        "summary": "Abort a request by `rid` (or a room by `bootstrap_room` on a worker)",
        "requestBody": {"required": True, **_json(_ref("AbortRequest"))},
        "responses": {"200": {"description": "Whether something was aborted",
                              **_json({"type": "object"})}, **_errors("400", "401", "413")}}},
    "/health": {"get": {"summary": "Liveness", "responses": {
        "200": {"description": "The process serves", **_json({"type": "object"})}}}},
    "/health_generate": {"get": {"summary": "Generates one token end to end", "responses": {
        "200": {"description": "A token was generated", **_json({"type": "object"})},
        "503": {"description": "Generation failed or timed out", **_json({"type": "object"})}}}},
    "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format)", "responses": {
        "200": {"description": "Metrics", "content": {"text/plain": {"schema": {
            "type": "string"}}}}}}},
    "/debug/rooms": {"get": {"summary": "Live rooms: id, role, state, age, deadline", "responses": {
        "200": {"description": "Rooms", **_json({"type": "object"})}}}},
    "/debug/workers": {"get": {"summary": "Router: every worker's role, url, pid, health",
                               "responses": {"200": {"description": "Workers",
                                                     **_json({"type": "object"})}}}},
    "/openapi.json": {"get": {"summary": "This document", "responses": {
        "200": {"description": "OpenAPI 3.1", **_json({"type": "object"})}}}},
}


def _apply_limits(schemas: dict[str, Any], vocab_size: int | None,
                  max_model_len: int | None) -> None:
    """Bounds that depend on the served model: token ids < vocab, lengths < the model length."""

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            items = node.get("items")
            if vocab_size and isinstance(items, dict) and items.get("type") == "integer" \
                    and items.get("minimum") == 0:
                node["items"] = {**items, "maximum": vocab_size - 1}
                if max_model_len:
                    node["maxItems"] = max_model_len
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schemas)
    if max_model_len:
        for name, field in (("CompletionRequest", "max_tokens"),
                            ("ChatCompletionRequest", "max_tokens"),
                            ("ChatCompletionRequest", "max_completion_tokens"),
                            ("SamplingParams", "max_new_tokens")):
            schemas[name]["properties"][field]["maximum"] = max_model_len - 1


def openapi_schema(role: str, paths: list[str] | None = None, *, vocab_size: int | None = None,
                   max_model_len: int | None = None) -> dict[str, Any]:
    """The document for one app; `paths` limits it to the routes that app serves, and the
    model's vocabulary size and length bound token ids and lengths."""
    chosen = {p: v for p, v in PATHS.items() if paths is None or p in paths}
    schemas = copy.deepcopy(SCHEMAS)
    _apply_limits(schemas, vocab_size, max_model_len)
    return {
        "openapi": "3.1.0",
        "info": {"title": f"pdengine {role}", "version": "0.1.0",
                 "description": "pdengine public HTTP API (internal /internal/* routes excluded)"},
        "paths": copy.deepcopy(chosen),
        "components": {"schemas": schemas,
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}}},
    }
