"""`pdengine` command line: a thin dispatcher; each subcommand lives with its package."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("pdengine.server.launch", "serve_main", "router + prefill + decode workers on this machine"),
    "prefill": ("pdengine.server.launch", "prefill_main", "run one prefill worker"),
    "decode": ("pdengine.server.launch", "decode_main", "run one decode worker"),
    "router": ("pdengine.server.launch", "router_main", "run the router"),
    "sim": ("pdengine.fsm.simulator", "main", "deterministic room simulator (invariants I1, I2, I4)"),
    "probe": ("pdengine.server.probe", "main", "diagnostics against a running server (probe pins)"),
    "bench": ("pdengine.server.bench_cli", "main", "load tools against a running server"),
}


def _usage() -> str:
    lines = ["usage: pdengine <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"pdengine: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
