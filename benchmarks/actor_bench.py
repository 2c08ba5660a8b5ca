#!/usr/bin/env python3
"""Full room lifecycles per second through the room actor, at N live rooms.

A lifecycle: CreateRoom, Bootstrapped (destination info), ChunkSent + ChunkDone
for 4 chunks, SUCCESS on the last chunk, DeliverPages effect, removal. `live`
idle rooms sit in WAITING_FOR_INPUT the whole time (table and heap at size).

Baseline, same run: an asyncio.Queue consumer applying the same events to a
plain dict of states through a plain dict transition table (no deadlines, no
effects, no hook) — the floor any actor pays for a queue and a lookup.

    benchmarks/actor_bench.py [--lifecycles N] [--live N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import anyio

from pdengine.fsm import DeliverPages, ReleasePages, RoomActor, RoomDeadlines
from pdengine.fsm.events import Bootstrapped, ChunkDone, ChunkSent, CreateRoom

CHUNKS = 4
BATCH = 64  # rooms interleaved per producer step, so lifecycles overlap in the actor


def lifecycle_events(room_id: int) -> list[list[object]]:
    """Events of one room, grouped by phase so a batch of rooms can be interleaved."""
    phases: list[list[object]] = [
        [CreateRoom(room_id, "decode", peer="p0", pages=(room_id % 997, room_id % 991))],
        [Bootstrapped(room_id, peer="p0")],
    ]
    for c in range(CHUNKS):
        phases.append([ChunkSent(room_id, c), ChunkDone(room_id, c, is_last=c == CHUNKS - 1)])
    return phases


def schedule(first_id: int, count: int) -> list[object]:
    out: list[object] = []
    for start in range(first_id, first_id + count, BATCH):
        rooms = [lifecycle_events(r) for r in range(start, min(start + BATCH, first_id + count))]
        for phase in range(len(rooms[0])):
            for room in rooms:
                out.extend(room[phase])
    return out


async def run_actor(lifecycles: int, live: int) -> tuple[float, float]:
    freed: list[int] = []
    actor = RoomActor(deadlines=RoomDeadlines(3600, 3600, 3600, 3600, 3600), mailbox_size=4096)
    actor.on(DeliverPages, lambda e: freed.extend(e.pages))
    actor.on(ReleasePages, lambda e: freed.extend(e.pages))
    for rid in range(live):
        actor.apply(CreateRoom(rid, "decode", peer="idle"))
        actor.apply(Bootstrapped(rid))
    events = schedule(live, lifecycles)
    last = live + lifecycles - 1
    async with actor:
        t0, c0 = time.perf_counter(), time.process_time()
        for ev in events:
            await actor.post(ev)
        await actor.wait_terminal(last)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if actor.live_rooms != live or actor.counters.entered[4] != lifecycles:
            raise RuntimeError(f"bench lost rooms: live={actor.live_rooms}")
    return lifecycles / elapsed, lifecycles / cpu


async def run_baseline(lifecycles: int, live: int) -> tuple[float, float]:
    table = {
        (1, "CreateRoom"): 1,
        (1, "Bootstrapped"): 2,
        (2, "ChunkSent"): 3,
        (3, "ChunkSent"): 3,
        (3, "ChunkDone"): 3,
    }
    states: dict[int, int] = {rid: 2 for rid in range(live)}
    queue: asyncio.Queue = asyncio.Queue(maxsize=4096)
    done = asyncio.Event()
    last = live + lifecycles - 1

    async def consumer() -> None:
        while True:
            ev = await queue.get()
            name = type(ev).__name__
            if name == "CreateRoom":
                states[ev.room_id] = 1
                continue
            rid = ev.room_id
            states[rid] = table[(states[rid], name)]
            if name == "ChunkDone" and ev.is_last:
                del states[rid]
                if rid == last:
                    done.set()
                    return

    task = asyncio.create_task(consumer())
    events = schedule(live, lifecycles)
    t0, c0 = time.perf_counter(), time.process_time()
    for ev in events:
        await queue.put(ev)
    await done.wait()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    await task
    if len(states) != live:
        raise RuntimeError("baseline lost rooms")
    return lifecycles / elapsed, lifecycles / cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="room actor lifecycles/s vs a bare baseline")
    parser.add_argument("--lifecycles", type=int, default=50_000)
    parser.add_argument("--live", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    baseline, baseline_cpu = anyio.run(run_baseline, args.lifecycles, args.live)
    actor, actor_cpu = anyio.run(run_actor, args.lifecycles, args.live)
    result = {
        "bench": "actor",
        "lifecycles": args.lifecycles,
        "live_rooms": args.live,
        "lifecycles_per_s": round(actor, 1),
        "baseline_per_s": round(baseline, 1),
        "ratio": round(actor / baseline, 4),
        # per CPU-second of this process: what one core gives when the box is shared
        "lifecycles_per_cpu_s": round(actor_cpu, 1),
        "baseline_per_cpu_s": round(baseline_cpu, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"room actor : {actor:10.0f} lifecycles/s ({actor_cpu:.0f} per CPU-s)"
              f" at {args.live} live rooms")
        print(f"baseline   : {baseline:10.0f} lifecycles/s ({baseline_cpu:.0f} per CPU-s)"
              " (asyncio.Queue + dict table)")
        print(f"ratio      : {actor / baseline:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
