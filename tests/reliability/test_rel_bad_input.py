"""Bad input through the router of a real PD deployment (the colocated app's field-by-field
cases live in tests/serving/test_serving_errors.py): each is refused with the right 4xx naming
the field, the workers stay up, and nothing is left behind on them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from rel_cluster import Cluster, prompt_of, stream_completion

from pdengine.server.diagnostics_scrape import scrape_all

pytestmark = pytest.mark.timeout(300)

TOO_LONG = prompt_of(5000)  # the tiny model's context is 4096


@pytest.fixture(scope="module")
def client(pd: Cluster):
    with httpx.Client(base_url=pd.url, timeout=60.0, trust_env=False) as c:
        yield c


CASES = [
    ("/v1/completions", {"prompt": [5, 6], "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": [5, 6], "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 4095}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 6], "model": "not-served"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "model": "not-served"}, 404, "model"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, 400,
     "temperature"),
    ("/generate", {"input_ids": TOO_LONG}, 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "field"), CASES)
def test_router_refuses_with_the_field_named(client: httpx.Client, pd: Cluster, path: str,
                                             body: dict, status: int, field: str) -> None:
    for stream in (False, True):
        resp = client.post(path, json={**body, "stream": stream})
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert field in error["message"] or error.get("param") == field, error


def test_malformed_json_is_400(client: httpx.Client) -> None:
    for raw in (b"{", b'{"prompt": [1,2]', b"[1, 2]", b"\xff\xfe", b""):
        resp = client.post("/v1/completions", content=raw,
                           headers={"content-type": "application/json"})
        assert resp.status_code == 400, (raw, resp.text)
        assert resp.json()["error"]["message"]


def test_body_over_the_limit_is_413(client: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    resp = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text

    def chunks():  # no Content-Length: the limit must hold while streaming the body
        yield b'{"prompt": "'
        for _ in range(6):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    streamed = client.post("/v1/completions", content=chunks(),
                           headers={"content-type": "application/json"})
    assert streamed.status_code == 413, streamed.text


def _worker_counts(pd: Cluster) -> dict[str, float]:
    """Every counter and histogram count of both workers (what any request would move)."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        for scrape in scrape_all(c, pd.workers()):
            for (name, labels), value in scrape.samples.items():
                if name.endswith(("_total", "_count")):
                    out[f"{scrape.worker.role}:{name}{labels}"] = value
    return out


def test_refused_requests_touch_no_worker(client: httpx.Client, pd: Cluster) -> None:
    pd.wait_idle(30.0)
    before = _worker_counts(pd)
    for path, body, status, _ in CASES:
        assert client.post(path, json=body).status_code == status
    assert client.post("/v1/completions", content=b"{").status_code == 400
    assert _worker_counts(pd) == before
    assert pd.busy() == {} and pd.prefill.alive and pd.decode.alive and pd.router.alive


def test_too_many_concurrent_requests_get_429_never_a_crash(pd: Cluster) -> None:
    router = pd.extra_router("--max-concurrent-requests", "2")
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(
                lambda i: stream_completion(router.url, prompt_of(200, i), 12), range(8)))
        statuses = sorted(r.status for r in results)
        assert set(statuses) <= {200, 429}, results
        assert statuses.count(429) >= 1, "8 concurrent requests against a limit of 2"
        assert all(r.ok for r in results if r.status == 200), results
        for r in results:
            if r.status == 429:
                assert "concurrent" in r.error["message"], r
        assert router.alive and pd.prefill.alive and pd.decode.alive
        pd.wait_idle(30.0)
        assert stream_completion(router.url, prompt_of(64), 4).ok  # slots were given back
    finally:
        router.stop()


@pytest.mark.parametrize("params", [
    {"temperature": 1e-300}, {"temperature": 1e300}, {"temperature": 1e-30, "top_p": 1e-300},
    {"temperature": 5e-324, "top_k": 1}, {"top_p": 5e-324},
])
def test_extreme_valid_sampling_params_never_kill_a_worker(client: httpx.Client, pd: Cluster,
                                                           params: dict) -> None:
    # Found by the schemathesis fuzz: temperature=1e-300 made the sampler's softmax NaN, which
    # killed the compute loop of the worker for good (every later request got a 5xx).
    resp = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, **params})
    assert resp.status_code in (200, 400), resp.text
    assert stream_completion(pd.url, prompt_of(40), 3).ok
    assert pd.prefill.alive and pd.decode.alive
