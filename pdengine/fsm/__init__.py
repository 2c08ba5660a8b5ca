"""Room and request state machines, the room actor, the deterministic simulator.

Imports stdlib, `transitions` and `anyio` only (DESIGN.md section 4).
"""

from pdengine.fsm.actor import ActorCounters, MailboxFull, RoomActor, RoomResult
from pdengine.fsm.core import RoomCore
from pdengine.fsm.deadlines import RoomDeadlines
from pdengine.fsm.effects import (
    AckAbort,
    DeliverPages,
    Effect,
    QuarantinePages,
    ReleasePages,
    RoomTerminal,
    TellPeer,
)
from pdengine.fsm.request import (
    REQUEST_TRANSITIONS,
    REQUEST_TRIGGERS,
    RequestLifecycle,
    RequestState,
)
from pdengine.fsm.room import ROOM_TRANSITIONS, ROOM_TRIGGERS, Room, RoomState, TransitionHook

__all__ = [
    "REQUEST_TRANSITIONS",
    "REQUEST_TRIGGERS",
    "ROOM_TRANSITIONS",
    "ROOM_TRIGGERS",
    "AckAbort",
    "ActorCounters",
    "DeliverPages",
    "Effect",
    "MailboxFull",
    "QuarantinePages",
    "ReleasePages",
    "RequestLifecycle",
    "RequestState",
    "Room",
    "RoomActor",
    "RoomCore",
    "RoomDeadlines",
    "RoomResult",
    "RoomState",
    "RoomTerminal",
    "TellPeer",
    "TransitionHook",
]
