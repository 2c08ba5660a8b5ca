"""KV transport: moves a room's pages prefill -> decode and reports what happened as events.

``make_transport`` is the factory workers use; see ``base.py`` for the protocol
and ``docs/transport.md`` for the wire messages and the abort handshake.
"""

from __future__ import annotations

import random

from pdengine.transport.base import (
    AuxRecord,
    MsgKind,
    Role,
    Transport,
    TransportBackend,
    TransportError,
    WireMessage,
)
from pdengine.transport.faults import FaultConfig, FaultyBackend
from pdengine.transport.transfer import KVTransport

__all__ = [
    "AuxRecord",
    "FaultConfig",
    "FaultyBackend",
    "KVTransport",
    "MsgKind",
    "Role",
    "Transport",
    "TransportBackend",
    "TransportError",
    "WireMessage",
    "make_transport",
]


def make_transport(
    kind: str,
    name: str,
    role: Role,
    *,
    checksums: bool = True,
    write_deadline_s: float = 10.0,
    faults: FaultConfig | None = None,
    seed: int | random.Random | None = 0,
) -> KVTransport:
    """``kind``: "nixl" (UCX, across processes) or "loopback" (one process)."""
    backend: TransportBackend
    if kind == "nixl":
        from pdengine.transport.nixl import NixlBackend

        backend = NixlBackend(name)
    elif kind == "loopback":
        from pdengine.transport.loopback import LoopbackBackend

        backend = LoopbackBackend(name)
    else:
        raise ValueError(f"transport kind must be 'nixl' or 'loopback', not {kind!r}")
    if faults is not None:
        backend = FaultyBackend(backend, faults, seed)
    return KVTransport(backend, role, checksums=checksums, write_deadline_s=write_deadline_s)
