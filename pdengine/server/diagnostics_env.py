"""Worker settings for diagnosis from the environment: fault injection and raised deadlines.

    PDENGINE_FAULTS="stall_write=1.0"                 fields of pdengine.transport.FaultConfig
    PDENGINE_DEADLINES="transfer_progress_s=600,write_s=600"
                                                      fields of pdengine.fsm.RoomDeadlines, plus
                                                      write_s: the transport's WRITE deadline

Both are comma-separated ``key=number`` lists, read by `pdengine prefill|decode` (and so by
the workers `pdengine serve` starts, which inherit its environment). They exist to make a
stuck or faulty deployment on purpose — to see what `probe pins` and the traces say — and are
off unless set. A bad key or value is an error naming it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from pdengine.fsm import RoomDeadlines
from pdengine.transport import FaultConfig

FAULTS_ENV = "PDENGINE_FAULTS"
DEADLINES_ENV = "PDENGINE_DEADLINES"


def _pairs(env_name: str, text: str, allowed: set[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise ValueError(f"{env_name}: unknown setting {item!r}; known: {sorted(allowed)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"{env_name}: {key} must be a number, got {value!r}") from None
    return out


def worker_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`WorkerOptions` fields (faults, deadlines, write_deadline_s) set by the environment."""
    environ = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    faults = environ.get(FAULTS_ENV, "").strip()
    if faults:
        fields = {f.name: f.type for f in dataclasses.fields(FaultConfig)}
        values: dict[str, Any] = _pairs(FAULTS_ENV, faults, set(fields))
        if "max_delay_polls" in values:
            values["max_delay_polls"] = int(values["max_delay_polls"])
        options["faults"] = FaultConfig(**values)
    deadlines = environ.get(DEADLINES_ENV, "").strip()
    if deadlines:
        names = {f.name for f in dataclasses.fields(RoomDeadlines)}
        values = _pairs(DEADLINES_ENV, deadlines, names | {"write_s"})
        if "write_s" in values:
            options["write_deadline_s"] = values.pop("write_s")
        if values:
            base = RoomDeadlines()
            total = max(values.get("transfer_progress_s", 0.0), base.transfer_total_s)
            values.setdefault("transfer_total_s", total)
            options["deadlines"] = RoomDeadlines(**values)
    return options
