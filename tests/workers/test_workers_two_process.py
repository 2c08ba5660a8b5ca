"""Two real worker processes (`pdengine prefill` / `pdengine decode`, uvicorn on 127.0.0.1)
exchanging KV pages over real NIXL (UCX): parity with colocated, abort mid-transfer."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Iterator

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdengine.engine import Engine
from pdengine.types import SamplingParams

TOKEN = "two-process-secret"
SAMPLING = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
_READY = re.compile(r"pdengine (prefill|decode) ready: (http://\S+)")


class WorkerProcess:
    """`python -m pdengine.cli <role> --port 0 --transport nixl`, read until its ready line."""

    def __init__(self, role: str) -> None:
        # One compute thread per worker: two OpenMP pools spinning on a 2-core CI box slow
        # every step several-fold.
        env = {**os.environ, "PDENGINE_CLUSTER_TOKEN": TOKEN, "UCX_NET_DEVICES": "lo",
               "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdengine.cli", role, "--port", "0", "--transport", "nixl"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.url = ""
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if (m := _READY.search(line)) and not self.url:
                self.url = m.group(2)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> str:
        self._ready.wait(timeout)
        assert self.url, "worker did not start:\n" + "".join(self.lines[-30:])
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[str, str]]:
    procs = [WorkerProcess("prefill"), WorkerProcess("decode")]
    try:
        yield procs[0].wait_ready(120), procs[1].wait_ready(120)
    finally:
        for p in procs:
            p.stop()


async def _pd_request(client: httpx.AsyncClient, prefill: str, decode: str, ids: list[int],
                      room: int) -> tuple[httpx.Response, httpx.Response]:
    replies: dict[str, httpx.Response] = {}

    async def post(side: str, url: str, body: dict) -> None:
        replies[side] = await client.post(f"{url}/generate", json=body)

    common = {"input_ids": ids, "sampling_params": SAMPLING, "bootstrap_room": room}
    async with anyio.create_task_group() as tg:
        tg.start_soon(post, "prefill", prefill, common)
        tg.start_soon(post, "decode", decode,
                      {**common, "bootstrap_host": prefill, "stream": False})
    return replies["prefill"], replies["decode"]


async def _gauges(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdengine_rooms":
                out[f"rooms.{sample.labels['state']}"] = sample.value
            elif family.type == "gauge":
                out[sample.name.removeprefix("pdengine_")] = sample.value
    return out


def _busy(g: dict[str, float]) -> dict[str, float]:
    keys = ("kv_pages_used", "num_running_reqs", "num_queue_reqs",
            "num_prefill_bootstrap_queue_reqs", "num_prefill_inflight_queue_reqs",
            "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs")
    live = {k: v for k, v in g.items() if k in keys and v}
    live.update({k: v for k, v in g.items() if k.startswith("rooms.") and v})
    return live


async def _until_idle(client: httpx.AsyncClient, urls: tuple[str, ...], within: float) -> None:
    with anyio.fail_after(within):
        while True:
            busy = {u: _busy(await _gauges(client, u)) for u in urls}
            if not any(busy.values()):
                return
            await anyio.sleep(0.05)


async def test_nixl_between_processes_matches_colocated(workers) -> None:
    prefill, decode = workers
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (300, 420, 530)]  # 2-3 chunks
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    async with Engine("tiny") as colocated:
        expected = [(await colocated.generate(prompt_token_ids=p, params=params)).token_ids
                    for p in prompts]
    async with httpx.AsyncClient(timeout=60) as client:
        got: list = [None] * len(prompts)

        async def one(i: int) -> None:
            got[i] = await _pd_request(client, prefill, decode, prompts[i], rng.getrandbits(63))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        for want, (p_reply, d_reply) in zip(expected, got, strict=True):
            assert p_reply.status_code == 200 and p_reply.json()["state"] == "SUCCESS"
            assert d_reply.status_code == 200, d_reply.text
            assert d_reply.json()["output_ids"] == want
        await _until_idle(client, (prefill, decode), within=2)


async def test_abort_mid_transfer_over_nixl_leaves_both_sides_idle(workers) -> None:
    prefill, decode = workers
    ids = [random.Random(5).randrange(3, 250) for _ in range(3000)]  # 12 chunks of 256
    room = random.getrandbits(63)
    async with httpx.AsyncClient(timeout=60) as client:
        replies: dict[str, httpx.Response] = {}

        async def run() -> None:
            p, d = await _pd_request(client, prefill, decode, ids, room)
            replies.update(prefill=p, decode=d)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(30):
                while True:  # abort once the decode room is receiving chunks
                    rooms = (await client.get(f"{decode}/debug/rooms")).json()
                    rows = rooms["rooms"] if isinstance(rooms, dict) else rooms
                    if any(r["room_id"] == room and r["state"] == "TRANSFERRING" for r in rows):
                        break
                    await anyio.sleep(0.002)
            aborted = await client.post(f"{decode}/abort_request", json={"bootstrap_room": room})
            assert aborted.json()["aborted"] is True
        assert replies["prefill"].status_code == 502, replies["prefill"].text  # room FAILED
        assert "abort" in replies["prefill"].text
        assert replies["decode"].status_code != 200 or (
            replies["decode"].json()["meta_info"]["finish_reason"]["type"] == "abort")
        await _until_idle(client, (prefill, decode), within=2)
        text = (await client.get(f"{decode}/metrics")).text
        assert re.search(r'pdengine_num_aborted_requests_total\{role="decode"\} [1-9]', text)
