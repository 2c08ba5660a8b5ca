"""Across machines, on one box: the prefill and the decode worker in two network namespaces
joined by a veth pair, so the KV pages cross a real network path (NIXL/UCX over TCP on the
veth, no shared memory) — the deployment of a user with two machines.

Namespaces and addresses are this test's own: two namespaces it creates, a private /30
between them, removed by the fixture's finalizer whatever happens. The router runs next to
the decode worker; clients and probes run inside that namespace too (`ip netns exec`).
Needs root and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from rel_cluster import Cluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SUBNET = "10.213.77.{}/30"  # private, and only ever inside the namespaces made here
PREFILL_IP, DECODE_IP = "10.213.77.1", "10.213.77.2"
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # tiny model: layers x (K, V) x kv heads x dim x fp32
PAGE = 16


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"pdrel-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Namespaces:
    prefill: str
    decode: str
    prefill_if: str
    decode_if: str

    def exec(self, ns: str, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ})

    def tx_bytes(self) -> int:
        out = self.exec(self.prefill, "cat", f"/sys/class/net/{self.prefill_if}/statistics/tx_bytes")
        return int(out.stdout)


@pytest.fixture
def netns() -> Iterator[Namespaces]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    ns = Namespaces(f"pdrel-{tag}-p", f"pdrel-{tag}-d", f"pdp{tag}", f"pdd{tag}")
    try:
        steps = [
            ("netns", "add", ns.prefill), ("netns", "add", ns.decode),
            ("link", "add", ns.prefill_if, "type", "veth", "peer", "name", ns.decode_if),
            ("link", "set", ns.prefill_if, "netns", ns.prefill),
            ("link", "set", ns.decode_if, "netns", ns.decode),
            ("-n", ns.prefill, "addr", "add", SUBNET.format(1), "dev", ns.prefill_if),
            ("-n", ns.decode, "addr", "add", SUBNET.format(2), "dev", ns.decode_if),
            ("-n", ns.prefill, "link", "set", ns.prefill_if, "up"),
            ("-n", ns.decode, "link", "set", ns.decode_if, "up"),
            ("-n", ns.prefill, "link", "set", "lo", "up"),
            ("-n", ns.decode, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield ns
    finally:
        for name in (ns.prefill, ns.decode):  # deleting a namespace removes its veth end too
            _ip("netns", "del", name)
        _ip("link", "del", ns.prefill_if)  # only if it never left this namespace


def test_kv_crosses_a_veth_between_two_namespaces(netns: Namespaces, tmp_path) -> None:
    def ucx(dev: str) -> dict[str, str]:  # the veth only: no loopback, no shared memory
        return {"UCX_NET_DEVICES": dev, "UCX_TLS": "tcp,self"}

    c = Cluster(tmp_path, worker_env={"PDENGINE_DEADLINES": ""},
                prefill_env=ucx(netns.prefill_if), decode_env=ucx(netns.decode_if),
                hosts=(PREFILL_IP, DECODE_IP, DECODE_IP),
                wraps=(["ip", "netns", "exec", netns.prefill],
                       ["ip", "netns", "exec", netns.decode],
                       ["ip", "netns", "exec", netns.decode]))
    try:
        c.start()
        before = netns.tx_bytes()
        requests, prompt_max = 4, 1200
        # PD through the veth vs an in-process colocated engine, token for token.
        bench = netns.exec(netns.decode, sys.executable, "-m", "pdengine.cli", "bench",
                           "corruption", "--url", c.url, "--allow-remote", "--json",
                           "--requests", str(requests), "--max-prompt-tokens", str(prompt_max),
                           "--max-tokens", "8")
        assert bench.returncode == 0, f"{bench.stdout}\n{bench.stderr}\n{c.logs()}"
        result = json.loads(bench.stdout)
        assert result["compared"] == requests and result["mismatches"] == 0, result
        assert result["checksum_failures"] == 0 and result["errors"] == 0, result
        # The KV really went over the veth: at least the smallest prompt's pages per request
        # (the bench draws prompts of at least 64 tokens).
        sent = netns.tx_bytes() - before
        assert sent >= requests * PAGE * 4 * KV_BYTES_PER_TOKEN, sent
        probe = netns.exec(netns.decode, sys.executable, "-m", "pdengine.cli", "probe", "pins",
                           "--url", c.url, "--samples", "3", "--interval", "0.5", "--json")
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert json.loads(probe.stdout)["verdict"] in ("idle", "healthy")
    finally:
        c.close()
