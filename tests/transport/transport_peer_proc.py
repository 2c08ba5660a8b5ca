"""A second process holding one NIXL agent, driven by the test over a multiprocessing pipe.

The child runs a real ``KVTransport`` over ``FaultyBackend(NixlBackend)`` (faults off
unless a test turns them on) and keeps calling ``progress()`` between commands;
events it sees are kept and handed to the test on request.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from typing import Any

import torch

from pdengine.config import KVLayout
from pdengine.transport.base import AuxRecord
from pdengine.transport.faults import FaultConfig, FaultyBackend
from pdengine.transport.nixl import NixlBackend
from pdengine.transport.transfer import KVTransport


def fill_pattern(pool: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    flat = pool.view(pool.shape[0], -1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=generator, dtype=torch.uint8))


def event_record(event: Any) -> dict[str, Any]:
    return {"type": type(event).__name__, **dataclasses.asdict(event)}


def serve(conn: Any, name: str, role: str, layout: KVLayout, seed: int) -> None:
    pool = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
    if role == "prefill":
        fill_pattern(pool, seed)
    faulty = FaultyBackend(NixlBackend(name), FaultConfig(), seed)
    transport = KVTransport(faulty, role, write_deadline_s=5.0)  # type: ignore[arg-type]
    transport.register(pool)
    conn.send(transport.agent_metadata())
    events: list[dict[str, Any]] = []
    while True:
        events += [event_record(e) for e in transport.progress()]
        if not conn.poll(0.001):
            continue
        command, *args = conn.recv()
        if command == "stop":
            transport.close()
            conn.send("stopped")
            return
        conn.send(_run(command, args, transport, faulty, pool, events))


def _run(command: str, args: list[Any], transport: KVTransport, faulty: FaultyBackend,
         pool: torch.Tensor, events: list[dict[str, Any]]) -> Any:
    if command == "add_peer":
        return transport.add_peer(args[0])
    if command == "pages":
        return pool[list(args[0])].clone()
    if command == "descriptors":
        return faulty.inner.descriptors_posted  # type: ignore[attr-defined]
    if command == "events":
        out = list(events)
        events.clear()
        return out
    if command == "faults":
        faulty.config = FaultConfig(**args[0])
        return None
    if command == "write":
        peer, room, chunk, is_last, src, dst = args
        aux = AuxRecord(first_token=11, prompt_len=len(src)) if is_last else None
        return transport.write_pages(peer, room, chunk, is_last, src, dst, aux=aux)
    if command == "write_then_wait_for_abort":
        return _race_last_chunk(transport, *args)
    raise ValueError(f"unknown command {command}")


def _race_last_chunk(transport: KVTransport, peer: str, room: int, src: list[int],
                     dst: list[int]) -> dict[str, Any]:
    """Post the room's last chunk and make no progress until the peer's abort is read,
    so the abort certainly meets the WRITE in flight; then drain and report."""
    transport.write_pages(peer, room, 0, True, src, dst)
    posted_inflight = transport.inflight(room)
    deadline = time.monotonic() + 20
    seen_abort = False
    while not seen_abort and time.monotonic() < deadline:
        seen_abort = any(type(e).__name__ == "Abort" for e in transport.drain_notifications())
    inflight_at_abort = transport.inflight(room)
    refused = transport.write_pages(peer, room, 1, True, src[:1], dst[:1]) is None
    while transport.inflight(room) and time.monotonic() < deadline:
        transport.poll()
    return {"posted_inflight": posted_inflight, "seen_abort": seen_abort,
            "inflight_at_abort": inflight_at_abort, "refused_after_abort": refused,
            "acks_sent": transport.stats["abort_acks_sent"]}


def start_peer(name: str, role: str, layout: KVLayout, seed: int = 1) -> tuple[Any, Any, bytes]:
    """Spawn the peer; returns (process, pipe end, its agent metadata)."""
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child_end, name, role, layout, seed), daemon=True)
    process.start()
    if not parent_end.poll(60):
        process.kill()
        raise RuntimeError(f"peer {name} did not start")
    return process, parent_end, parent_end.recv()


def call(conn: Any, *command: Any, timeout: float = 30.0) -> Any:
    conn.send(command)
    if not conn.poll(timeout):
        raise TimeoutError(f"peer did not answer {command[0]}")
    return conn.recv()
