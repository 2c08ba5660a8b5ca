"""The colocated app on a real uvicorn server: OpenAI client, SSE, SGLang /generate, health,
metrics, OpenAPI, and a client disconnect that leaves nothing behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import ThreadServer, gauge, scrape
from openapi_spec_validator import validate

from pdengine.model import Tokenizer, resolve_model
from pdengine.server.app import create_colocated_app
from pdengine.server.context import AppSettings
from pdengine.telemetry.metrics import METRIC_NAMES

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_openai_completions_stream_and_not(colocated: ThreadServer) -> None:
    client = openai.OpenAI(base_url=colocated.url + "/v1", api_key="unused")
    full = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    tokenizer = Tokenizer.load(resolve_model("tiny"))
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(tokenizer.encode("Hello there"))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text  # greedy: same text streamed or not
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_openai_chat_stream_and_not(colocated: ThreadServer) -> None:
    client = openai.OpenAI(base_url=colocated.url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    tokenizer = Tokenizer.load(resolve_model("tiny"))
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(templated)  # the checkpoint's chat template was used
    assert full.usage.completion_tokens == 10

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_ends_with_done_and_generate_matches(colocated: ThreadServer) -> None:
    body = {"input_ids": [1, 20, 30, 40], "sampling_params": {"max_new_tokens": 9, **GREEDY}}
    whole = httpx.post(colocated.url + "/generate", json=body, timeout=60).json()
    assert len(whole["output_ids"]) == 9
    assert whole["meta_info"]["finish_reason"] == {"type": "length"}
    with httpx.stream("POST", colocated.url + "/generate", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[-1]["output_ids"] == whole["output_ids"]  # cumulative, like SGLang
    assert objs[-1]["text"] == whole["text"]
    assert len(objs) == 9  # one event per token


def test_models_health_and_debug(colocated: ThreadServer) -> None:
    models = httpx.get(colocated.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    health = httpx.get(colocated.url + "/health").json()
    assert health["status"] == "ok" and health["role"] == "colocated"
    assert httpx.get(colocated.url + "/health_generate", timeout=60).json()["generated"] is True
    rooms = httpx.get(colocated.url + "/debug/rooms").json()
    assert rooms == {"role": "colocated", "count": 0, "rooms": []}  # no transfer rooms


def test_metrics_exposition_has_every_metric(colocated: ThreadServer) -> None:
    httpx.post(colocated.url + "/generate", timeout=60,
               json={"text": "metrics", "sampling_params": {"max_new_tokens": 3, **GREEDY}})
    samples = scrape(colocated.url)
    names = {name for name, _ in samples}
    for metric in METRIC_NAMES:
        assert any(n == metric or n.startswith(metric + "_") for n in names), metric
    assert gauge(samples, "pdengine_time_to_first_token_seconds_count", "colocated") >= 1
    assert gauge(samples, "pdengine_inter_token_latency_seconds_count", "colocated") >= 2


def test_openapi_is_valid_and_lists_the_endpoints(colocated: ThreadServer) -> None:
    doc = httpx.get(colocated.url + "/openapi.json").json()
    validate(doc)  # raises on an invalid OpenAPI 3.1 document
    expected = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/generate",
                "/abort_request", "/health", "/health_generate", "/metrics", "/debug/rooms",
                "/openapi.json"}
    assert set(doc["paths"]) == expected
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    # bounds of the served model, so a schema-driven fuzzer generates in-range ids
    ids = doc["components"]["schemas"]["GenerateRequest"]["properties"]["input_ids"]
    vocab = Tokenizer.load(resolve_model("tiny")).vocab_size
    assert ids["items"]["maximum"] == vocab - 1


def test_client_disconnect_mid_stream_returns_to_idle(colocated: ThreadServer) -> None:
    before = scrape(colocated.url)
    aborted0 = gauge(before, "pdengine_num_aborted_requests_total", "colocated")
    body = {"prompt": "a long one " * 20, "max_tokens": 3000, "stream": True, **GREEDY}
    with httpx.stream("POST", colocated.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept open: leaving a for-loop over it would hang up early
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        running = gauge(scrape(colocated.url), "pdengine_num_running_reqs", "colocated")
        assert running == 1  # the request is live while we read it
    # the client hung up mid-stream: the engine must drop the request and its pages
    deadline = time.monotonic() + 2.0
    while True:
        samples = scrape(colocated.url)
        idle = (gauge(samples, "pdengine_num_running_reqs", "colocated") == 0
                and gauge(samples, "pdengine_num_queue_reqs", "colocated") == 0
                and gauge(samples, "pdengine_kv_pages_used", "colocated") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, samples
    assert gauge(samples, "pdengine_num_aborted_requests_total", "colocated") == aborted0 + 1


def test_abort_request_ends_the_stream_with_an_error_event(colocated: ThreadServer) -> None:
    body = {"text": "abort me", "rid": "abort-me-1", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, **GREEDY}}
    with httpx.stream("POST", colocated.url + "/generate", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                answer = httpx.post(colocated.url + "/abort_request", json={"rid": "abort-me-1"})
                assert answer.json() == {"rid": "abort-me-1", "aborted": True}
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "request_aborted"
    assert len(events) < 100


@pytest.fixture(scope="module")
def guarded() -> ThreadServer:
    settings = AppSettings(api_key="sekrit", max_concurrent_requests=1)
    with ThreadServer(create_colocated_app("tiny", settings=settings)) as server:
        yield server


def test_api_key_guards_public_endpoints(guarded: ThreadServer) -> None:
    assert httpx.get(guarded.url + "/v1/models").status_code == 401
    wrong = httpx.get(guarded.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(guarded.url + "/health").status_code == 200  # probes stay open
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sekrit")
    assert client.models.list().data[0].id == "tiny"


def test_too_many_concurrent_requests_is_429(guarded: ThreadServer) -> None:
    auth = {"Authorization": "Bearer sekrit"}
    body = {"text": "hold the slot", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, **GREEDY}}
    with httpx.stream("POST", guarded.url + "/generate", json=body, headers=auth,
                      timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        second = httpx.post(guarded.url + "/generate", headers=auth,
                            json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "rate_limit_error"
    # the slot comes back once the first client is gone
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        third = httpx.post(guarded.url + "/generate", headers=auth,
                           json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
        if third.status_code == 200:
            break
        time.sleep(0.05)
    assert third.status_code == 200


def test_pdengine_serve_colocated_cli_serves_and_stops_cleanly() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "pdengine.cli", "serve", "--colocated",
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pdengine ready: http://127.0.0.1:"), line
        url = line.split()[-1]
        answer = httpx.post(url + "/v1/completions", timeout=60,
                            json={"prompt": "cli", "max_tokens": 2, **GREEDY}).json()
        assert answer["usage"]["completion_tokens"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_openai_logprobs(colocated: ThreadServer) -> None:
    client = openai.OpenAI(base_url=colocated.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0.0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        # greedy: the chosen token is the most likely candidate
        assert entry.logprob == max(c.logprob for c in entry.top_logprobs)
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                           temperature=0.0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_disconnect_before_the_first_token_aborts(colocated: ThreadServer) -> None:
    aborted0 = gauge(scrape(colocated.url), "pdengine_num_aborted_requests_total", "colocated")
    body = {"input_ids": [i % 250 + 1 for i in range(1000)], "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", colocated.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200  # hang up after the headers, before reading a token
    deadline = time.monotonic() + 2.0
    while True:
        samples = scrape(colocated.url)
        idle = all(gauge(samples, name, "colocated") == 0 for name in (
            "pdengine_num_running_reqs", "pdengine_num_queue_reqs", "pdengine_kv_pages_used"))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, samples
    assert gauge(samples, "pdengine_num_aborted_requests_total", "colocated") == aborted0 + 1
