"""The request lifecycle FSM, on top of rooms (same rules: table as data, terminals absorb).

    QUEUED --start_prefill--> PREFILLING --start_transfer--> TRANSFERRING --start_decode--> DECODING
    PREFILLING --start_decode--> DECODING          (colocated mode: no transfer)
    QUEUED --start_decode--> DECODING              (decode side: KV arrives with the request)
    DECODING --finish--> FINISHED
    every non-terminal state --abort--> ABORTED, --fail--> FAILED
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

from pdengine.fsm.machine import TableMachine


class RequestState(IntEnum):
    QUEUED = 0
    PREFILLING = 1
    TRANSFERRING = 2
    DECODING = 3
    FINISHED = 4
    ABORTED = 5
    FAILED = 6

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})
_Q, _P, _T, _D = (
    RequestState.QUEUED,
    RequestState.PREFILLING,
    RequestState.TRANSFERRING,
    RequestState.DECODING,
)
_LIVE = [_Q, _P, _T, _D]

REQUEST_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "start_prefill", "source": [_Q], "dest": _P},
    {"trigger": "start_transfer", "source": [_P], "dest": _T},
    {"trigger": "start_decode", "source": [_Q, _P, _T], "dest": _D},
    {"trigger": "finish", "source": [_D], "dest": RequestState.FINISHED},
    {"trigger": "abort", "source": _LIVE, "dest": RequestState.ABORTED},
    {"trigger": "fail", "source": _LIVE, "dest": RequestState.FAILED},
]

REQUEST_MACHINE = TableMachine("request", RequestState, REQUEST_TRANSITIONS, _Q, _TERMINAL)
REQUEST_TRIGGERS: tuple[str, ...] = REQUEST_MACHINE.triggers

# hook(request, trigger, src, dst, absorbed)
RequestHook = Callable[["RequestLifecycle", str, RequestState, RequestState, bool], None]


class RequestLifecycle:
    """Where one request is. Absorbed triggers (terminal or no row) change nothing and
    are counted (`late_events` / `invalid_events`) and passed to the hook."""

    __slots__ = ("hook", "invalid_events", "late_events", "reason", "request_id", "state")

    def __init__(self, request_id: str, hook: RequestHook | None = None) -> None:
        self.request_id = request_id
        self.hook = hook
        self.state = RequestState.QUEUED
        self.reason = ""
        self.late_events = 0
        self.invalid_events = 0

    def __repr__(self) -> str:
        return f"RequestLifecycle({self.request_id!r}, {self.state.name})"

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def fire(self, trigger: str, reason: str = "") -> bool:
        src = self.state
        dst = REQUEST_MACHINE.fire(src, trigger)
        if dst is None:
            if src.terminal:
                self.late_events += 1
            else:
                self.invalid_events += 1
            if self.hook is not None:
                self.hook(self, trigger, src, src, True)
            return False
        self.state = dst
        if reason:
            self.reason = reason
        if self.hook is not None:
            self.hook(self, trigger, src, dst, False)
        return True

    def start_prefill(self) -> bool:
        return self.fire("start_prefill")

    def start_transfer(self) -> bool:
        return self.fire("start_transfer")

    def start_decode(self) -> bool:
        return self.fire("start_decode")

    def finish(self) -> bool:
        return self.fire("finish")

    def abort(self, reason: str = "aborted") -> bool:
        return self.fire("abort", reason)

    def fail(self, reason: str = "failed") -> bool:
        return self.fire("fail", reason)
