"""`pdengine serve` as real processes (router + prefill + decode, NIXL between the workers):
PD output equals the colocated engine's, the OpenAI client works against the router, and
client disconnects bring every gauge on both workers back to idle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import httpx
import openai
import pytest
from conftest import ThreadServer, scrape
from openapi_spec_validator import validate
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdengine.config import Deadlines
from pdengine.engine import Engine
from pdengine.server.router_app import create_router_app
from pdengine.server.supervisor import die_with_parent
from pdengine.types import SamplingParams

IDLE_GAUGES = (
    "pdengine_num_prefill_bootstrap_queue_reqs",
    "pdengine_num_prefill_inflight_queue_reqs",
    "pdengine_num_decode_prealloc_queue_reqs",
    "pdengine_num_decode_transfer_queue_reqs",
    "pdengine_num_running_reqs",
    "pdengine_num_queue_reqs",
    "pdengine_kv_pages_used",
    "pdengine_rooms",
)


class Serve:
    def __init__(self, *args: str, headers: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(  # dies with the test process, whatever happens
            [sys.executable, "-m", "pdengine.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent())
        try:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()  # the one stdout line, once all are healthy
            if not line.startswith("pdengine ready: "):
                raise RuntimeError(f"pdengine serve did not start: {line!r}")
            self.url = line.split()[-1]
            workers = httpx.get(self.url + "/debug/workers", headers=headers).json()["workers"]
            self.workers = {w["role"]: w for w in workers}
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return [httpx.get(self.url + "/health").json()["pid"],
                *(w["pid"] for w in self.workers.values())]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of an exited parent counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pd() -> Iterator[Serve]:
    serve = Serve("--transport", "nixl")
    pids = serve.pids()
    yield serve
    assert serve.stop() == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "a child outlived `pdengine serve`"


def worker_samples(pd: Serve) -> dict[str, dict]:
    return {role: scrape(w["url"]) for role, w in pd.workers.items()}


def busy_gauges(pd: Serve) -> dict[str, float]:
    """Every non-zero idle gauge on both workers and the router (empty when idle)."""
    out = {}
    for role, samples in {**worker_samples(pd), "router": scrape(pd.url)}.items():
        for (name, labels), value in samples.items():
            if name in IDLE_GAUGES and value != 0:
                out[f"{role}:{name}{dict(labels)}"] = value
    return out


def wait_idle(pd: Serve, within_s: float = 2.0) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while (busy := busy_gauges(pd)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return busy


def prompts() -> list[list[int]]:
    """Prompts of 40..520 tokens: the longer ones need two or three 256-token prefill chunks."""
    lengths = [40, 300, 520, 130]
    return [[(7 * i + 13 * n) % 250 + 1 for i in range(n)] for n in lengths]


async def test_pd_greedy_equals_colocated_token_for_token(pd: Serve) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with Engine("tiny") as engine:
        expected = [(await engine.generate(prompt_token_ids=p, params=params)).token_ids
                    for p in prompts()]
    got: dict[int, list[int]] = {}

    async def one(i: int, ids: list[int], client: httpx.AsyncClient) -> None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                      "ignore_eos": True}}
        r = await client.post(pd.url + "/generate", json=body)
        assert r.status_code == 200, r.text
        got[i] = r.json()["output_ids"]

    async with httpx.AsyncClient(timeout=120) as client, anyio.create_task_group() as tg:
        for i, ids in enumerate(prompts()):  # all at once: one concurrent batch
            tg.start_soon(one, i, ids, client)
    assert [got[i] for i in range(len(expected))] == expected
    assert wait_idle(pd) == {}


def test_openai_client_against_the_router(pd: Serve) -> None:
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="unused")
    extra = {"ignore_eos": True}
    full = client.completions.create(model="tiny", prompt="Disaggregated " * 10, max_tokens=8,
                                     temperature=0.0, extra_body=extra)
    assert full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny", prompt="Disaggregated " * 10,
                                         max_tokens=8, temperature=0.0, stream=True,
                                         extra_body=extra)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text

    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0.0, extra_body=extra)
    assert chat.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                 temperature=0.0, stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_router_debug_endpoints(pd: Serve) -> None:
    workers = httpx.get(pd.url + "/debug/workers").json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["healthy"] and isinstance(w["pid"], int) for w in workers)
    assert len(set(pd.pids())) == 3  # three processes
    rooms = httpx.get(pd.url + "/debug/rooms").json()
    assert rooms["errors"] == [] and rooms["count"] == len(rooms["rooms"])



def test_worker_endpoints_refuse_bad_requests_and_guard_internal_routes(pd: Serve) -> None:
    prefill, decode = pd.workers["prefill"]["url"], pd.workers["decode"]["url"]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(prefill + "/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    r = httpx.post(decode + "/generate",
                   json={**body, "bootstrap_room": 5, "bootstrap_host": "ftp://elsewhere"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_host"
    assert httpx.get(prefill + "/internal/heartbeat").status_code == 401
    wrong = httpx.get(decode + "/internal/heartbeat", headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 403
    for url in (prefill, decode, pd.url):
        doc = httpx.get(url + "/openapi.json").json()
        validate(doc)
        assert "/generate" in doc["paths"] and not any(p.startswith("/internal") for p in doc["paths"])
    assert "/debug/workers" in httpx.get(pd.url + "/openapi.json").json()["paths"]

def test_disconnect_mid_stream_returns_every_gauge_to_idle(pd: Serve) -> None:
    body = {"prompt": [i % 250 + 1 for i in range(600)], "max_tokens": 3000, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", pd.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        running = worker_samples(pd)["decode"][("pdengine_num_running_reqs",
                                                (("role", "decode"),))]
        assert running == 1  # decoding when the client hangs up
    assert wait_idle(pd) == {}


def test_disconnect_before_the_first_token_returns_to_idle(pd: Serve) -> None:
    """Hang up while the prompt is still being prefilled or transferred."""
    for cut_after_s in (0.0, 0.05):
        # Long enough that only the disconnect can end it within wait_idle's 2 s.
        body = {"input_ids": [i % 250 + 1 for i in range(520)], "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with httpx.stream("POST", pd.url + "/generate", json=body, timeout=30) as r:
            assert r.status_code == 200
            time.sleep(cut_after_s)  # then hang up without reading a token
        assert wait_idle(pd) == {}


def test_abort_request_through_the_router(pd: Serve) -> None:
    body = {"text": "abort me", "rid": "pd-abort-1", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", pd.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    twin = httpx.post(pd.url + "/generate", json={**body, "stream": False})
                    assert twin.status_code == 400 and twin.json()["error"]["param"] == "rid"
                    answer = httpx.post(pd.url + "/abort_request", json={"rid": "pd-abort-1"})
                    assert answer.json()["aborted"] is True
    assert events[-1] == "[DONE]" and '"request_aborted"' in events[-2]
    assert wait_idle(pd) == {}


def broken_prefill_app(calls: list[str]) -> Starlette:
    """A worker that passes health checks but fails every request (fault injection)."""

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "role": "prefill", "pid": os.getpid()})

    async def fail(request: Request) -> JSONResponse:
        calls.append(request.url.path)
        return JSONResponse({"error": {"message": "injected failure"}}, status_code=503)

    return Starlette(routes=[Route("/health", health), Route("/generate", fail, methods=["POST"]),
                             Route("/internal/{rest:path}", fail, methods=["GET", "POST"])])


def test_router_retries_once_then_reports_a_clear_error(pd: Serve) -> None:
    calls: list[str] = []
    body = {"input_ids": prompts()[1], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    direct = httpx.post(pd.url + "/generate", json=body, timeout=60).json()
    prefill_url, decode_url = pd.workers["prefill"]["url"], pd.workers["decode"]["url"]
    with ThreadServer(broken_prefill_app(calls)) as broken:
        # a broken pair first (round robin), then a good one: the retry serves the request
        with ThreadServer(create_router_app([broken.url, prefill_url], [decode_url])) as router:
            via_retry = httpx.post(router.url + "/generate", json=body, timeout=60)
            assert via_retry.status_code == 200, via_retry.text
            assert via_retry.json()["output_ids"] == direct["output_ids"]
            assert calls.count("/generate") == 1  # the first pair was tried and failed

        # only broken pairs: one retry, then a clear error
        calls.clear()
        with ThreadServer(create_router_app([broken.url], [decode_url])) as router:
            r = httpx.post(router.url + "/generate", json=body, timeout=60)
            assert r.status_code == 502
            assert r.json()["error"]["type"] == "upstream_error"
            assert "injected failure" in r.json()["error"]["message"]
            assert calls.count("/generate") == 2
            with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True},
                              timeout=60) as s:
                assert s.status_code == 502  # nothing streamed yet: a real status
    # The decode side quarantines a failed room's pages until its prefill peer acknowledges
    # the abort or the drain deadline passes (I5); the broken peer never answers.
    assert wait_idle(pd, within_s=Deadlines().drain_s + 5) == {}


def test_children_die_with_a_killed_parent() -> None:
    """SIGKILL leaves `pdengine serve` no chance to clean up: the children must notice."""
    serve = Serve("--transport", "nixl")
    pids = serve.pids()
    serve.proc.kill()
    serve.proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_dead_worker_takes_the_deployment_down_cleanly() -> None:
    """`pdengine serve` does not keep serving with half a cluster: it stops and says so."""
    serve = Serve("--transport", "nixl")
    pids = serve.pids()
    os.kill(serve.workers["decode"]["pid"], signal.SIGKILL)
    assert serve.proc.wait(30) == 1
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_api_key_guards_the_router_and_the_workers() -> None:
    auth = {"Authorization": "Bearer k3y"}
    serve = Serve("--transport", "nixl", "--api-key", "k3y", headers=auth)
    try:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(serve.url + "/generate", json=body).status_code == 401
        assert httpx.post(serve.workers["decode"]["url"] + "/generate", json=body
                          ).status_code == 401  # the workers got the key from serve
        ok = httpx.post(serve.url + "/v1/completions", headers=auth, timeout=60,
                        json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(serve.url + "/debug/rooms", headers=auth).json()["errors"] == []
    finally:
        assert serve.stop() == 0
