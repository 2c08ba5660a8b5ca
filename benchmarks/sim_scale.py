#!/usr/bin/env python3
"""Room lifecycles at scale in the deterministic simulator (`pdengine sim`), with faults.

Runs seeded worlds (two real room actors, lossy/duplicating/late network, WRITE errors,
client aborts, peer deaths) until at least `--lifecycles` rooms reached a terminal state,
split over `--jobs` processes, and checks 0 violations of I1/I2/I4/I5. The baseline, measured
in the same run, is a fault-free simulation of `--baseline-seeds` worlds: the ratio says what
the faults cost per lifecycle.

    benchmarks/sim_scale.py [--lifecycles 1000000] [--rooms 16] [--jobs 2] [--json]

Exit status 1 on any violation (the first one is printed, shrunk, by the simulator).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pdengine.fsm.sim_world import Faults
from pdengine.fsm.simulator import run_seeds

NO_FAULTS = Faults(loss=0.0, duplicate=0.0, late=0.0, abort=0.0, write_error=0.0,
                   peer_death=0.0)


def _chunk(args: tuple[int, int, int, bool]) -> dict[str, Any]:
    seeds, rooms, first_seed, faulty = args
    return run_seeds(seeds, rooms, first_seed, Faults() if faulty else NO_FAULTS)


def lifecycles_of(summary: dict[str, Any]) -> int:
    return int(summary.get("rooms_succeeded", 0) + summary.get("rooms_failed", 0))


def simulate(lifecycles: int, rooms: int, jobs: int, faulty: bool = True) -> dict[str, Any]:
    """Seeded worlds until `lifecycles` rooms (two per request) ended; merged summary."""
    per_seed = 2 * rooms  # a prefill room and a decode room per request
    seeds = -(-lifecycles // per_seed)
    step = -(-seeds // (jobs * 8))  # several chunks per job: even load, visible progress
    plan = [(min(step, seeds - s), rooms, s, faulty) for s in range(0, seeds, step)]
    started = time.perf_counter()
    merged: dict[str, Any] = {}
    first_failure = None
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for part in pool.map(_chunk, plan):
            first_failure = first_failure or part.get("first_failure")
            for key, value in part.items():
                if key in ("seeds", "events", "violations", "rooms_succeeded", "rooms_failed",
                           "timeouts", "late_events", "invalid_events", "pages_quarantined"):
                    merged[key] = merged.get(key, 0) + value
            merged["max_time_to_terminal_s"] = max(merged.get("max_time_to_terminal_s", 0.0),
                                                   part["max_time_to_terminal_s"])
            merged["deadline_bound_s"] = part["deadline_bound_s"]
    elapsed = time.perf_counter() - started
    merged.update(lifecycles=lifecycles_of(merged), elapsed_s=round(elapsed, 2),
                  lifecycles_per_s=round(lifecycles_of(merged) / elapsed, 1))
    if first_failure is not None:
        merged["first_failure"] = first_failure
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lifecycles", type=int, default=1_000_000,
                   help="terminal rooms to simulate (default 1,000,000)")
    p.add_argument("--rooms", type=int, default=16, help="requests per simulated world")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--baseline-seeds", type=int, default=2000,
                   help="fault-free worlds for the baseline rate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if min(args.lifecycles, args.rooms, args.jobs, args.baseline_seeds) < 1:
        p.error("every count must be >= 1")
    baseline = simulate(args.baseline_seeds * 2 * args.rooms, args.rooms, args.jobs, False)
    faulty = simulate(args.lifecycles, args.rooms, args.jobs, True)
    result = {
        "bench": "sim_scale",
        **{k: v for k, v in faulty.items() if k != "first_failure"},
        "baseline_lifecycles_per_s": baseline["lifecycles_per_s"],
        "faulty_vs_fault_free_rate": round(
            faulty["lifecycles_per_s"] / max(baseline["lifecycles_per_s"], 1e-9), 3),
        "baseline_violations": baseline["violations"],
    }
    violations = faulty["violations"] + baseline["violations"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"simulated {result['lifecycles']:,} room lifecycles ({result['seeds']:,} worlds "
              f"x {args.rooms} requests) with faults in {result['elapsed_s']} s: "
              f"{result['lifecycles_per_s']:,.0f}/s")
        print(f"violations {faulty['violations']}, timeouts {result.get('timeouts', 0):,}, "
              f"late events {result.get('late_events', 0):,}, "
              f"max time to terminal {result['max_time_to_terminal_s']} s "
              f"(bound {result['deadline_bound_s']} s)")
        print(f"baseline (no faults): {baseline['lifecycles_per_s']:,.0f}/s; "
              f"ratio faulty/fault-free {result['faulty_vs_fault_free_rate']}")
    failure = faulty.get("first_failure") or baseline.get("first_failure")
    if failure is not None:
        print(f"VIOLATION seed={failure['seed']}: {failure['violation']}", file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
