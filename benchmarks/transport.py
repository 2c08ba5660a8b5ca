#!/usr/bin/env python3
"""KV transport throughput: two processes over NIXL/UCX vs an in-process memcpy.

This process is the prefill side (``KVTransport`` over ``NixlBackend``); a spawned
process is the decode side, draining notifications and verifying checksums.
Pages are realistic: 16 tokens x 32 layers x K,V x 8 kv heads x 128 dim x fp16
= 2 MiB. ``--mib`` MiB (default 256) move in chunks of ``--chunk-pages`` pages;
the time runs from the first post to the decode side's last verified
``ChunkDone``. Measured with checksums on and off; the baseline is a
``Tensor.copy_`` of the same bytes in this process, in the same run.

Orchestration overhead: chunks sent one at a time; per chunk, the time from
"chunk ready" (before ``write_pages``) to "decode notified" (``ChunkDone`` out
of ``drain_notifications``) minus the wire time of the same bytes as a bare
NIXL WRITE without checksum or notification (median of each).

    benchmarks/transport.py [--mib 256] [--chunk-pages 16] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,self,sm")

import torch
import xxhash

from pdengine.config import KVLayout
from pdengine.fsm.events import ChunkDone
from pdengine.transport.base import PageRun, XferState
from pdengine.transport.nixl import NixlBackend
from pdengine.transport.transfer import KVTransport

GIB = 1024**3


def layout_for(mib: int) -> KVLayout:
    page = KVLayout(num_pages=1, num_layers=32, page_size=16, num_kv_heads=8, head_dim=128,
                    dtype="float16")
    return KVLayout(num_pages=mib * 2**20 // page.page_nbytes, num_layers=32, page_size=16,
                    num_kv_heads=8, head_dim=128, dtype="float16")


def decode_side(conn: Any, layout: KVLayout, checksums: bool) -> None:
    """Receiver: drain notifications as fast as possible, time-stamp each verified chunk."""
    pool = torch.zeros(layout.shape, dtype=torch.float16)
    transport = KVTransport(NixlBackend("bench-decode"), "decode", checksums=checksums)
    transport.register(pool)
    conn.send(transport.agent_metadata())
    transport.add_peer(conn.recv())
    arrivals: list[tuple[int, int, bool, float]] = []
    while True:
        for event in transport.drain_notifications():
            ok = isinstance(event, ChunkDone) and event.checksum_ok
            arrivals.append((event.room_id, getattr(event, "chunk", -1), ok, time.monotonic()))
        if conn.poll(0):
            command, arg = conn.recv()
            if command == "arrivals":
                conn.send(arrivals)
                arrivals = []
            elif command == "checksums":
                transport.checksums = arg
                conn.send(None)
            elif command == "digest":
                conn.send(xxhash.xxh3_64(pool.view(torch.uint8).numpy()).intdigest())
            else:
                transport.close()
                conn.send(None)
                return


def wait_arrivals(conn: Any, count: int, timeout: float = 120.0) -> list[tuple]:
    got: list[tuple] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(got)} of {count} chunks arrived")
        conn.send(("arrivals", None))
        got += conn.recv()
    return got


def send_all(sender: KVTransport, peer: str, conn: Any, layout: KVLayout, chunk_pages: int,
             room: int) -> tuple[float, bool]:
    """Post every chunk as soon as it is 'ready'; seconds until the last verified arrival."""
    chunks = [list(range(s, min(s + chunk_pages, layout.num_pages)))
              for s in range(0, layout.num_pages, chunk_pages)]
    started = time.monotonic()
    for index, pages in enumerate(chunks):
        sender.write_pages(peer, room, index, index == len(chunks) - 1, pages, pages)
        sender.poll()
    while sender.inflight(room):
        sender.poll()
    arrivals = wait_arrivals(conn, len(chunks))
    return max(a[3] for a in arrivals) - started, all(a[2] for a in arrivals)


def orchestration(sender: KVTransport, peer: str, conn: Any, chunk_pages: int,
                  samples: int, first_room: int) -> dict[str, float]:
    """Median chunk-ready -> decode-notified, and the bare NIXL wire time of the same pages."""
    pages = list(range(chunk_pages))
    end_to_end, wire = [], []
    for i in range(samples):
        ready = time.monotonic()
        sender.write_pages(peer, first_room + i, 0, True, pages, pages)
        while sender.inflight(first_room + i):
            sender.poll()
        (arrival,) = wait_arrivals(conn, 1)
        end_to_end.append(arrival[3] - ready)
        start = time.monotonic()
        handle = sender.backend.post_write(peer, [PageRun(0, 0, chunk_pages)], b"")
        while sender.backend.check(handle)[0] is XferState.PENDING:
            pass
        wire.append(time.monotonic() - start)
        sender.backend.release(handle)
    e2e, w = statistics.median(end_to_end), statistics.median(wire)
    return {"chunk_to_notified_ms": e2e * 1e3, "wire_ms": w * 1e3, "overhead_ms": (e2e - w) * 1e3}


def memcpy_gib_s(src: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return src.numel() * src.element_size() / best / GIB


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--chunk-pages", type=int, default=16, help="16 pages = 256 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    layout = layout_for(args.mib)
    src = torch.empty(layout.shape, dtype=torch.float16)
    src.view(torch.int16).random_()
    nbytes = src.numel() * src.element_size()

    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=decode_side, args=(child_end, layout, True), daemon=True)
    child.start()
    sender = KVTransport(NixlBackend("bench-prefill"), "prefill", write_deadline_s=60.0)
    sender.register(src)
    peer = sender.add_peer(conn.recv())
    conn.send(sender.agent_metadata())
    try:
        send_all(sender, peer, conn, layout, args.chunk_pages, 0)  # warm-up: connection, pages
        results: dict[str, Any] = {}
        for checksums in (True, False):
            sender.checksums = checksums
            conn.send(("checksums", checksums))
            conn.recv()
            descriptors_before = sender.backend.descriptors_posted
            base = 1000 if checksums else 2000  # room ids are never reused
            runs = [send_all(sender, peer, conn, layout, args.chunk_pages, base + r)
                    for r in range(args.repeats)]
            results[checksums] = {
                "gib_s": nbytes / min(t for t, _ in runs) / GIB,
                "ok": all(ok for _, ok in runs),
                "descriptors": (sender.backend.descriptors_posted - descriptors_before)
                // args.repeats,
                "orchestration": orchestration(sender, peer, conn, args.chunk_pages, 9, base + 100),
            }
        conn.send(("digest", None))
        bytes_match = conn.recv() == xxhash.xxh3_64(src.view(torch.uint8).numpy()).intdigest()
        hash_s = min(_timed(lambda: xxhash.xxh3_64(src.view(torch.uint8).numpy()))
                     for _ in range(args.repeats))
        baseline = memcpy_gib_s(src, args.repeats)
    finally:
        conn.send(("stop", None))
        conn.recv()
        child.join(10)
        sender.close()

    on, off = results[True], results[False]
    report = {
        "bytes": nbytes,
        "page_nbytes": layout.page_nbytes,
        "chunk_pages": args.chunk_pages,
        "transport_gib_s": round(on["gib_s"], 3),
        "transport_gib_s_no_checksum": round(off["gib_s"], 3),
        "memcpy_gib_s": round(baseline, 3),
        "ratio": round(on["gib_s"] / baseline, 3),
        "ratio_no_checksum": round(off["gib_s"] / baseline, 3),
        "checksum_ok": on["ok"] and off["ok"] and bytes_match,
        "checksum_gib_s": round(nbytes / hash_s / GIB, 3),
        "descriptors": on["descriptors"],
        "chunks": -(-layout.num_pages // args.chunk_pages),
        "orchestration_ms": {k: round(v, 3) for k, v in on["orchestration"].items()},
        "orchestration_ms_no_checksum": {
            k: round(v, 3) for k, v in off["orchestration"].items()},
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"moved {nbytes / 2**20:.0f} MiB in {report['chunks']} chunks of "
              f"{args.chunk_pages} x {layout.page_nbytes / 2**20:.0f} MiB pages, "
              f"{report['descriptors']} descriptors")
        print(f"memcpy (baseline)     {baseline:7.2f} GiB/s")
        print(f"transport, checksums  {on['gib_s']:7.2f} GiB/s  ratio {report['ratio']:.3f}")
        print(f"transport, no checks  {off['gib_s']:7.2f} GiB/s  "
              f"ratio {report['ratio_no_checksum']:.3f}")
        print(f"xxh3_64 alone         {report['checksum_gib_s']:7.2f} GiB/s  "
              f"checksum_ok={report['checksum_ok']}")
        for label, key in (("checksums on", "orchestration_ms"),
                           ("checksums off", "orchestration_ms_no_checksum")):
            o = report[key]
            print(f"per chunk ({label}): ready->notified {o['chunk_to_notified_ms']:.2f} ms, "
                  f"wire {o['wire_ms']:.2f} ms, overhead {o['overhead_ms']:.2f} ms")
    return 0 if report["checksum_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
