"""`pdengine bench`: load tools against a running deployment (DESIGN.md §1.7).

    pdengine bench abort-storm --url URL [--requests 100] [--rounds 5] [--prompt-tokens 2000] [--json]
    pdengine bench corruption  --url URL [--requests 16] [--reference-url URL] [--json]

Both only target loopback URLs (127.0.0.1, localhost, ::1) unless `--allow-remote` is given:
they send real load. Counts and times are bounded. Exit codes: 0 clean, 1 a pin, leak,
mismatch or checksum failure was found, 2 the deployment could not be driven.
"""

from __future__ import annotations

import argparse
import sys

import anyio

from pdengine.server.diagnostics_corruption import CorruptionConfig, run_corruption
from pdengine.server.diagnostics_scrape import DiagnosticsError, is_loopback
from pdengine.server.diagnostics_storm import StormConfig, run_storm

MAX_REQUESTS = 10_000
MAX_ROUNDS = 1_000
MAX_PROMPT_TOKENS = 1_000_000


def _bounded(lo: float, hi: float, kind: type = int):
    def parse(text: str):
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}]")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdengine bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--url", default="http://127.0.0.1:8000", help="the router's URL")
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--allow-remote", action="store_true", help="allow a non-loopback URL")

    storm = sub.add_parser("abort-storm", help="aborted streams, then a pin and leak check")
    common(storm)
    storm.add_argument("--requests", type=_bounded(1, MAX_REQUESTS), default=100)
    storm.add_argument("--rounds", type=_bounded(1, MAX_ROUNDS), default=5)
    storm.add_argument("--prompt-tokens", type=_bounded(1, MAX_PROMPT_TOKENS), default=2000)
    storm.add_argument("--max-tokens", type=_bounded(2, 4096), default=32)
    storm.add_argument("--drain-timeout", type=_bounded(0.1, 600, float), default=30.0,
                       help="seconds to wait for quiescence after each round")
    storm.add_argument("--no-progress", action="store_true", help="no progress line on stderr")

    corr = sub.add_parser("corruption", help="PD vs colocated greedy outputs, token for token")
    common(corr)
    corr.add_argument("--requests", type=_bounded(1, MAX_REQUESTS), default=16)
    corr.add_argument("--reference-url", default=None,
                      help="a colocated server (default: an in-process colocated Engine)")
    corr.add_argument("--model", default=None, help="model of the in-process reference")
    corr.add_argument("--max-tokens", type=_bounded(1, 4096), default=16)
    corr.add_argument("--max-prompt-tokens", type=_bounded(2, MAX_PROMPT_TOKENS), default=1024)
    return p


def _refuse_remote(args: argparse.Namespace) -> str | None:
    urls = [args.url, getattr(args, "reference_url", None)]
    remote = [u for u in urls if u and not is_loopback(u if "://" in u else f"http://{u}")]
    if remote and not args.allow_remote:
        return f"refusing to load non-loopback {remote[0]!r} (pass --allow-remote to mean it)"
    return None


def _storm(args: argparse.Namespace) -> int:
    cfg = StormConfig(
        url=args.url.rstrip("/"),
        requests=args.requests,
        rounds=args.rounds,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        drain_timeout_s=args.drain_timeout,
    )
    result = anyio.run(run_storm, cfg, not args.no_progress)
    if args.json:
        print(result.to_json())
    else:
        print(
            f"abort storm: {result.rounds} rounds x {cfg.requests} requests, "
            f"{result.aborted} aborted {result.cuts}, {result.completed} completed, "
            f"{result.errors} errors {result.error_kinds or ''}\n"
            f"pins {result.pins}, leaked pages {result.leaked_pages}, "
            f"slowest drain {result.drain_seconds_max:.3f}s"
            + (f"\nstill busy: {result.still_busy}" if result.still_busy else "")
            + "".join(f"\n{kind}: {text}" for kind, text in result.error_examples.items())
        )
    return 0 if result.ok else 1


def _corruption(args: argparse.Namespace) -> int:
    cfg = CorruptionConfig(
        url=args.url.rstrip("/"),
        requests=args.requests,
        reference_url=args.reference_url.rstrip("/") if args.reference_url else None,
        model=args.model,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        min_prompt_tokens=min(64, args.max_prompt_tokens),
        seed=args.seed,
    )
    result = anyio.run(run_corruption, cfg)
    if args.json:
        print(result.to_json())
    else:
        print(
            f"corruption: {result.compared}/{result.requests} compared against {result.reference}, "
            f"{result.mismatches} mismatches, {result.errors} errors, "
            f"{result.checksum_failures} checksum failures"
            + (f"\nfirst mismatch: {result.first_mismatch}" if result.first_mismatch else "")
            + (f"\nfirst error: {result.first_error}" if result.first_error else "")
        )
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    refusal = _refuse_remote(args)
    if refusal:
        print(f"pdengine bench: {refusal}", file=sys.stderr)
        return 2
    try:
        return _storm(args) if args.bench == "abort-storm" else _corruption(args)
    except DiagnosticsError as exc:
        print(f"pdengine bench {args.bench}: {exc}", file=sys.stderr)
        return 2
