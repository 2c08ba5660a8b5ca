"""The room FSM: one KV transfer between a prefill (sender) and a decode (receiver) worker.

States keep the KVPoll integers. The table is data, handed to `transitions`
(`auto_transitions=False`; SUCCESS and FAILED are final):

    BOOTSTRAPPING --bootstrap--> WAITING_FOR_INPUT --chunk_sent|chunk_done--> TRANSFERRING
    TRANSFERRING --chunk_sent|chunk_done--> TRANSFERRING (progress) --succeed--> SUCCESS
    every non-terminal state --abort|fail|timeout--> FAILED

Progress rows (`dest: None`) are `transitions` *internal* transitions: the
state stays and no exit/enter runs; the actor restarts the progress deadline
on them (see `machine.py` for how they are executed cheaply).

A chunk event is also accepted in BOOTSTRAPPING: a chunk proves the peer
bootstrapped, so a bootstrap acknowledgement that loses the race to the first
chunk must not strand the room.

Absorbed events (no transition, no exception) come in two kinds:
- *late*: any trigger on a terminal room (I1: a terminal state is never left);
- *invalid*: a trigger with no row for the current non-terminal state (a
  duplicate `bootstrap`, `succeed` before any chunk). These are absorbed and
  counted, not turned into failures: duplicated and reordered deliveries are
  normal on a network, and the state deadline (I2) still bounds the room.

One hook path: every state change and every absorbed event calls
`hook(room, trigger, src, dst, absorbed)`; for an absorbed event `dst == src`
and `absorbed` is True (late when `src` is terminal, invalid otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

from pdengine.fsm.machine import TableMachine


class RoomState(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_SET


_B, _W, _T = RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING
NON_TERMINAL: tuple[RoomState, ...] = (_B, _W, _T)
TERMINAL: tuple[RoomState, ...] = (RoomState.SUCCESS, RoomState.FAILED)
_TERMINAL_SET = frozenset(TERMINAL)

ROOM_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "bootstrap", "source": [_B], "dest": _W},
    {"trigger": "chunk_sent", "source": [_B, _W], "dest": _T},
    {"trigger": "chunk_sent", "source": [_T], "dest": None},  # progress: internal transition
    {"trigger": "chunk_done", "source": [_B, _W], "dest": _T},
    {"trigger": "chunk_done", "source": [_T], "dest": None},
    {"trigger": "succeed", "source": [_T], "dest": RoomState.SUCCESS},
    {"trigger": "abort", "source": list(NON_TERMINAL), "dest": RoomState.FAILED},
    {"trigger": "fail", "source": list(NON_TERMINAL), "dest": RoomState.FAILED},
    {"trigger": "timeout", "source": list(NON_TERMINAL), "dest": RoomState.FAILED},
]

ROOM_MACHINE = TableMachine("room", RoomState, ROOM_TRANSITIONS, _B, TERMINAL)
ROOM_TRIGGERS: tuple[str, ...] = ROOM_MACHINE.triggers

# hook(room, trigger, src, dst, absorbed)
TransitionHook = Callable[["Room", str, RoomState, RoomState, bool], None]
ROLES = ("prefill", "decode")


class Room:
    """One transfer room. Only its owner (the room actor) calls the trigger methods.

    Besides the state it carries what the actor needs to decide effects: the
    peer, the local KV pages it holds, chunk bookkeeping, its current deadline.
    Trigger methods return True when the state changed.
    """

    __slots__ = (
        "aux",
        "chunks_done",
        "created_at",
        "deadline",
        "dst_pages",
        "from_peer",
        "heap_time",
        "hook",
        "invalid_events",
        "last_chunk",
        "late_events",
        "num_chunks",
        "pages",
        "peer",
        "quarantined",
        "reason",
        "role",
        "room_id",
        "state",
        "state_since",
        "transfer_started",
    )

    def __init__(
        self,
        room_id: int,
        role: str,
        *,
        peer: str = "",
        pages: tuple[int, ...] = (),
        num_chunks: int | None = None,
        hook: TransitionHook | None = None,
        now: float = 0.0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.room_id = room_id
        self.role = role
        self.peer = peer
        self.pages = pages
        self.dst_pages: tuple[int, ...] = ()
        self.num_chunks = num_chunks
        self.hook = hook
        self.state: RoomState = RoomState.BOOTSTRAPPING
        self.created_at = now
        self.state_since = now
        self.transfer_started = now
        self.deadline = float("inf")
        self.heap_time = float("inf")
        self.chunks_done: set[int] = set()
        self.last_chunk: int | None = None if num_chunks is None else num_chunks - 1
        self.reason = ""
        self.from_peer = ""  # "" | "abort" (peer aborted) | "dead" (peer failed)
        self.quarantined = False
        self.aux: dict[str, Any] | None = None
        self.late_events = 0
        self.invalid_events = 0

    def __repr__(self) -> str:
        return f"Room({self.room_id}, {self.role}, {self.state.name})"

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def fire(self, trigger: str) -> bool:
        """Apply `trigger` through the shared machine; absorb it if it has no row."""
        src = self.state
        dst = ROOM_MACHINE.fire(src, trigger)
        if dst is None:
            return self.absorb(trigger)
        self.state = dst
        if self.hook is not None:
            self.hook(self, trigger, src, dst, False)
        return True

    def absorb(self, trigger: str) -> bool:
        """Count and report an event that changes nothing (also used for duplicates)."""
        src = self.state
        if src.terminal:
            self.late_events += 1
        else:
            self.invalid_events += 1
        if self.hook is not None:
            self.hook(self, trigger, src, src, True)
        return False

    def bootstrap(self) -> bool:
        return self.fire("bootstrap")

    def chunk_sent(self) -> bool:
        return self.fire("chunk_sent")

    def chunk_done(self) -> bool:
        return self.fire("chunk_done")

    def succeed(self) -> bool:
        return self.fire("succeed")

    def abort(self) -> bool:
        return self.fire("abort")

    def fail(self) -> bool:
        return self.fire("fail")

    def timeout(self) -> bool:
        return self.fire("timeout")
