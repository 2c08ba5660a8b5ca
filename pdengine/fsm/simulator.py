"""`pdengine sim`: run many seeded worlds, check I1/I2/I4/I5, shrink the first failure.

    pdengine sim --seeds N [--rooms M] [--first-seed S] [--json]

Each seed builds a `World` (two real room actors, a faulty network, page
ledgers; see `sim_world.py`) with M requests and runs it to quiescence on a
fake clock. On a violation the recorded schedule of the first failing seed is
shrunk (delta debugging over replays) to the shortest subsequence that still
breaks the same invariant; it is printed with the seed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pdengine.fsm.room import RoomState
from pdengine.fsm.sim_world import Faults, Step, World


def shrink(
    seed: int,
    rooms: int,
    schedule: list[Step],
    invariant: str,
    faults: Faults | None = None,
    max_replays: int = 3000,
) -> list[Step]:
    """Shortest subsequence of `schedule` found whose replay still violates `invariant`."""
    replays = 0

    def fails(candidate: list[Step]) -> bool:
        nonlocal replays
        replays += 1
        world = World(seed, rooms, faults or Faults())
        world.replay(candidate)
        return any(v.invariant == invariant for v in world.violations)

    current, parts = list(schedule), 2
    while len(current) > 1 and replays < max_replays:
        size = -(-len(current) // parts)
        for start in range(0, len(current), size):
            candidate = current[:start] + current[start + size :]
            if fails(candidate):
                current, parts = candidate, max(parts - 1, 2)
                break
        else:
            if parts >= len(current):
                break
            parts = min(len(current), parts * 2)
    return current


def run_seeds(
    seeds: int,
    rooms: int,
    first_seed: int = 0,
    faults: Faults | None = None,
    on_world: Callable[[World], None] | None = None,
) -> dict[str, Any]:
    """Run `seeds` worlds; returns the summary (and the first failure, shrunk)."""
    faults = faults or Faults()
    started, cpu_started = time.perf_counter(), time.process_time()
    totals: Counter[str] = Counter()
    max_ttt = 0.0
    failure: dict[str, Any] | None = None
    bound = 0.0
    for seed in range(first_seed, first_seed + seeds):
        world = World(seed, rooms, faults)
        world.run()
        bound = world.bound_s
        if on_world is not None:
            on_world(world)
        totals["events"] += world.steps
        totals["violations"] += len(world.violations)
        max_ttt = max(max_ttt, world.max_time_to_terminal_s)
        for actor in world.actors.values():
            c = actor.counters
            totals["rooms_succeeded"] += c.entered[RoomState.SUCCESS]
            totals["rooms_failed"] += c.entered[RoomState.FAILED]
            totals["timeouts"] += c.timeouts
            totals["late_events"] += c.late_events
            totals["invalid_events"] += c.invalid_events
            totals["pages_quarantined"] += c.pages_quarantined
        if world.violations and failure is None:
            first = world.violations[0]
            short = shrink(seed, rooms, world.recording, first.invariant, faults)
            failure = {
                "seed": seed,
                "violation": str(first),
                "schedule_len": len(world.recording),
                "shrunk_schedule": [str(step) for step in short],
            }
    summary: dict[str, Any] = {
        "seeds": seeds,
        "first_seed": first_seed,
        "rooms": rooms,
        "events": totals.pop("events", 0),
        "violations": totals.pop("violations", 0),
        "max_time_to_terminal_s": round(max_ttt, 4),
        "deadline_bound_s": bound,
        **dict(totals),
        "elapsed_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(time.process_time() - cpu_started, 2),
    }
    if failure is not None:
        summary["first_failure"] = failure
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdengine sim", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000, help="number of seeded worlds")
    parser.add_argument("--rooms", type=int, default=8, help="requests per world")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.rooms < 1:
        parser.error("--seeds and --rooms must be >= 1")
    summary = run_seeds(args.seeds, args.rooms, args.first_seed)
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            if key != "first_failure":
                print(f"{key:>24}: {value}")
    failure = summary.get("first_failure")
    if failure is not None:
        print(f"VIOLATION seed={failure['seed']}: {failure['violation']}", file=sys.stderr)
        print(
            f"shortest schedule ({len(failure['shrunk_schedule'])} of "
            f"{failure['schedule_len']} steps):",
            file=sys.stderr,
        )
        for line in failure["shrunk_schedule"]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
