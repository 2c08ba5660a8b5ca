#!/usr/bin/env python3
"""Run every benchmarks/*.py script (except this one) in turn and print its output.

Scripts are discovered, so a new benchmark needs no registration; a short size
for `make bench` can be given in QUICK_ARGS (otherwise the script's own defaults).
A failing script is reported and makes the exit status non-zero; the rest still run.

    benchmarks/run_all.py [--only NAME ...] [--full]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Short default sizes for `make bench`; scripts not listed run with their own defaults.
QUICK_ARGS: dict[str, list[str]] = {
    "actor_bench": ["--lifecycles", "20000"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="script names (without .py)")
    parser.add_argument("--full", action="store_true", help="run with the scripts' own sizes")
    args = parser.parse_args(argv)
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name)
    if args.only:
        scripts = [p for p in scripts if p.stem in args.only]
    failed = []
    for script in scripts:
        extra = [] if args.full else QUICK_ARGS.get(script.stem, [])
        cmd = [sys.executable, str(script), *extra]
        print(f"== {script.name} {' '.join(extra)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            failed.append(script.name)
            sys.stdout.write(proc.stderr[-4000:])
        print(f"-- {script.name}: exit {proc.returncode} in {time.perf_counter() - t0:.1f} s\n")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
