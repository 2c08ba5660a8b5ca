"""Security of a real deployment (docs/security.md):

- the internal (worker-to-worker) endpoints refuse a missing (401) or wrong (403) cluster
  token, and a peer refused for its token is not registered: no destination is accepted
  from it and no KV byte is written for it;
- `--api-key` guards the public endpoints (probes stay open), compared in constant time;
- every role binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import base64
import hmac
import os
import signal
import socket
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import httpx
import pytest
from rel_cluster import Cluster, free_port, prompt_of, stream_completion, wait_for
from starlette.requests import Request

from pdengine.server import auth, internal

pytestmark = pytest.mark.timeout(300)

INTERNAL = [("POST", "/internal/register"), ("POST", "/internal/destination"),
            ("GET", "/internal/heartbeat")]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(("method", "path"), INTERNAL)
def test_internal_endpoints_need_the_cluster_token(pd: Cluster, role: str, method: str,
                                                   path: str) -> None:
    url = getattr(pd, role).url + path
    body = {"peer": "intruder", "agent_metadata": base64.b64encode(b"x").decode(),
            "room_id": 1, "dst_pages": [0]}
    with httpx.Client(timeout=10.0, trust_env=False) as c:
        kwargs = {"json": body} if method == "POST" else {}
        missing = c.request(method, url, **kwargs)
        wrong = c.request(method, url, headers={"Authorization": "Bearer not-the-token"},
                          **kwargs)
        other_scheme = c.request(method, url, headers={"Authorization": f"Basic {pd.token}"},
                                 **kwargs)
    assert missing.status_code == 401, missing.text
    assert other_scheme.status_code == 401, other_scheme.text
    assert wrong.status_code == 403, wrong.text
    assert "token" in wrong.json()["error"]["message"]


def test_a_refused_peer_gets_no_kv(pd: Cluster) -> None:
    """An intruder that reaches the prefill worker's public /generate (no token needed there)
    and offers destination pages, with a wrong token or none, gets nothing written to it."""
    room = 4242
    bad = {"Authorization": "Bearer wrong"}
    with httpx.Client(timeout=60.0, trust_env=False) as c:
        writes_before = pd.counter(pd.prefill, "kv_transfer_latency_ms_count")
        reg = c.post(f"{pd.prefill.url}/internal/register", headers=bad,
                     json={"peer": "intruder",
                           "agent_metadata": base64.b64encode(b"agent").decode()})
        assert reg.status_code == 403

        result: dict[str, httpx.Response] = {}

        def prefill_request() -> None:
            result["r"] = c.post(f"{pd.prefill.url}/generate", json={
                "input_ids": prompt_of(300), "sampling_params": {"max_new_tokens": 2},
                "bootstrap_room": room})

        t = threading.Thread(target=prefill_request, daemon=True)
        t.start()
        wait_for(lambda: any(r["room_id"] == room for r in
                             c.get(f"{pd.prefill.url}/debug/rooms").json()["rooms"]),
                 30.0, "the intruder's room on the prefill worker")
        for headers in (bad, {}):
            dest = c.post(f"{pd.prefill.url}/internal/destination", headers=headers,
                          json={"room_id": room, "peer": "intruder", "dst_pages": [0, 1, 2]})
            assert dest.status_code in (401, 403), dest.text
        # With the token but as a peer that never registered: refused too.
        dest = c.post(f"{pd.prefill.url}/internal/destination",
                      headers={"Authorization": f"Bearer {pd.token}"},
                      json={"room_id": room, "peer": "intruder", "dst_pages": [0, 1, 2]})
        assert dest.status_code == 409 and dest.json()["error"]["field"] == "peer"
        # Nobody claims the room: it ends by its bootstrap deadline, never transferring.
        c.post(f"{pd.prefill.url}/abort_request", json={"bootstrap_room": room})
        t.join(60)
        assert result["r"].status_code >= 400
    assert pd.counter(pd.prefill, "kv_transfer_latency_ms_count") == writes_before
    pd.wait_idle(30.0)


def test_api_key_guards_public_endpoints(pd: Cluster) -> None:
    key = "s3cret-key"
    router = pd.extra_router("--api-key", key)
    try:
        with httpx.Client(timeout=60.0, trust_env=False) as c:
            body = {"prompt": [5, 6, 7], "max_tokens": 2}
            missing = c.post(f"{router.url}/v1/completions", json=body)
            wrong = c.post(f"{router.url}/v1/completions", json=body,
                           headers={"Authorization": "Bearer s3cret-kez"})
            models = c.get(f"{router.url}/v1/models")
            assert (missing.status_code, wrong.status_code, models.status_code) == (401, 401, 401)
            for path in ("/health", "/metrics", "/openapi.json"):  # probes stay open
                assert c.get(router.url + path).status_code == 200, path
        ok = stream_completion(router.url, prompt_of(40), 3,
                               headers={"Authorization": f"Bearer {key}"})
        assert ok.ok, ok
    finally:
        router.stop()


def test_secrets_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API key and the cluster token both go through `hmac.compare_digest`."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert auth.keys_match("abc", "abc") and not auth.keys_match("abd", "abc")
    assert seen == [(b"abc", b"abc"), (b"abd", b"abc")]
    seen.clear()
    request = Request({"type": "http", "headers": [(b"authorization", b"Bearer guess")]})
    denied = internal._check_token(request, "cluster-token")
    assert denied is not None and denied.status_code == 403
    assert seen == [(b"guess", b"cluster-token")]


def _listening_address(port: int) -> str:
    """The local address a TCP socket listens on for `port` (from /proc/net/tcp)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if int(hexport, 16) == port and state == "0A":  # LISTEN
                    return socket.inet_ntoa(bytes.fromhex(addr)[::-1]) if len(addr) == 8 \
                        else addr
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_serve_binds_loopback_by_default(tmp_path) -> None:
    """`pdengine serve` without --host: the router and both workers listen on 127.0.0.1."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDENGINE_")}
    cmd = [sys.executable, "-m", "pdengine.cli", "serve", "--model", "tiny", "--port", str(port)]
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def workers() -> list[dict]:
            with httpx.Client(timeout=2.0, trust_env=False) as c:
                return c.get(f"{url}/debug/workers").json()["workers"]

        listed = wait_for(workers, 180.0, f"pdengine serve\n{(tmp_path / 'serve.log').read_text()}")
        ports = [port] + [urlsplit(w["url"]).port for w in listed]
        assert len(ports) == 3
        assert [_listening_address(p) for p in ports] == ["127.0.0.1"] * 3
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
