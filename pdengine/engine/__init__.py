"""The embedded engine API: `Engine(model=..., mode="colocated" | "pd")`."""

from __future__ import annotations

from typing import Any

from pdengine.engine.base import EngineBase, RequestStream
from pdengine.engine.colocated import ColocatedEngine
from pdengine.types import InvalidRequestError

MODES = ("colocated", "pd")


def Engine(model: str = "tiny", *, mode: str = "colocated", **options: Any) -> EngineBase:
    """Make an engine; use it as `async with Engine(...) as engine`.

    `mode="colocated"` (default) runs prefill and decode in one process;
    `mode="pd"` runs a prefill and a decode worker with a KV transfer between
    them, behind the same API. `options` go to the chosen engine class.
    """
    if mode == "colocated":
        return ColocatedEngine(model, **options)
    if mode == "pd":
        from pdengine.engine.pd import PDEngine  # the PD stack is only imported when asked for

        return PDEngine(model, **options)
    raise InvalidRequestError("mode", f"must be one of {MODES}, not {mode!r}")


__all__ = ["MODES", "ColocatedEngine", "Engine", "EngineBase", "RequestStream"]
