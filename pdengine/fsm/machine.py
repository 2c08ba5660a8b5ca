"""A declarative FSM table executed by one shared `transitions.Machine`.

Why shared: a `transitions.Machine` per object costs 130-320 µs to build and
`add_model` on a shared machine is O(n) (~40 µs each at 2,000 models), which
caps room churn far below the 5,000 lifecycles/s a worker needs. Instead each
table gets ONE machine bound to a private cursor model; a transition loads the
object's state into the cursor, runs the real `transitions` event (its source
check, its `final` states) and reads the destination back (~9 µs per trigger).
Internal rows (state kept, e.g. transfer progress) are answered from the
compiled table: the tables carry no callbacks, so `transitions` would do
nothing for them but cost 4.5 µs, and they are most of a room's events.
This is safe because an FSM table is only ever driven from one actor task.

Absorption (DESIGN.md I1) is decided before `transitions` is asked: a trigger
from a terminal state, or one with no transition from the current state, is
absorbed — no state change, no exception — and reported as such.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any

from transitions import Machine


class _Cursor:
    """The one model the shared machine knows; it holds a borrowed state."""

    state: Any


class TableMachine:
    """Compiled view of a transition table plus the shared machine that executes it."""

    def __init__(
        self,
        name: str,
        states: type[IntEnum],
        table: Sequence[Mapping[str, Any]],
        initial: IntEnum,
        final: Iterable[IntEnum],
    ) -> None:
        self.name = name
        self.states = states
        self.initial = initial
        self.final: frozenset[IntEnum] = frozenset(final)
        self.triggers: tuple[str, ...] = tuple(dict.fromkeys(row["trigger"] for row in table))
        self.valid: dict[tuple[IntEnum, str], IntEnum] = {}
        for row in table:
            sources = row["source"] if isinstance(row["source"], list | tuple) else [row["source"]]
            for src in sources:
                key = (states(src), row["trigger"])
                if key in self.valid:
                    raise ValueError(f"{name}: duplicate transition {key}")
                if key[0] in self.final:
                    raise ValueError(f"{name}: transition out of final state {key}")
                # dest None: a `transitions` internal transition (state kept, no exit/enter)
                self.valid[key] = key[0] if row["dest"] is None else states(row["dest"])
        state_defs = [{"name": s, "final": s in self.final} for s in states]
        self._cursor = _Cursor()
        self._machine = Machine(
            model=self._cursor,
            states=state_defs,
            transitions=[dict(row) for row in table],
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            name=name,
        )
        self._events = self._machine.events

    def is_final(self, state: IntEnum) -> bool:
        return state in self.final

    def fire(self, state: IntEnum, trigger: str) -> IntEnum | None:
        """Destination of `trigger` from `state` via `transitions`, or None if absorbed."""
        dst = None if state in self.final else self.valid.get((state, trigger))
        if dst is None or dst is state:
            # absorbed, or an internal progress row: tables carry no callbacks, so
            # `transitions` would run nothing for it; skip its ~4.5 µs
            return dst
        cursor = self._cursor
        cursor.state = state
        self._events[trigger].trigger(cursor)
        return cursor.state

    def rows(self) -> list[tuple[IntEnum, str, IntEnum]]:
        """Every (source, trigger, dest) triple, in table order (for docs and tests)."""
        return [(src, trig, dst) for (src, trig), dst in self.valid.items()]
