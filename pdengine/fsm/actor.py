"""The room actor: the one owner of every room of a worker process (DESIGN.md I3).

Public API
----------
    actor = RoomActor(deadlines=RoomDeadlines(...) | config.Deadlines,
                      clock=time.monotonic, rng=random.Random(), mailbox_size=4096,
                      hook=None)                       # hook(room, trigger, src, dst, absorbed)
    actor.on(ReleasePages, free_fn)                    # effect handlers (sync, non-blocking)
    async with actor:                                  # or: tg.start_soon(actor.run); ...; actor.close()
        await actor.post(CreateRoom(7, "decode", peer="p0", pages=(3, 4)))   # waits when full
        actor.post_nowait(Abort(7))                    # raises MailboxFull when full
        result = await actor.wait_terminal(7)          # RoomResult(room_id, state, reason, aux)

Synchronous step API (`pdengine.fsm.core.RoomCore`, the base class: what
`run()` itself uses; the simulator drives it under a fake clock, no event loop):
    actor.apply(event)        apply one typed event from pdengine.fsm.events
    actor.expire_due()        turn every expired deadline into a Timeout (or a drain release)
    actor.next_deadline()     earliest armed deadline, or None

Introspection: `counters` (ActorCounters), `gauges()`, `snapshot()` (rows for
/debug/rooms), `get(room_id)`, `result(room_id)`, `live_rooms`.

A room's life inside the actor
------------------------------
CreateRoom -> BOOTSTRAPPING; Bootstrapped -> WAITING_FOR_INPUT; ChunkSent /
ChunkDone -> TRANSFERRING (each chunk event restarts the progress deadline,
capped by `transfer_total_s`; a duplicate ChunkDone is absorbed);
ChunkDone once every chunk up to the last (``is_last`` or ``num_chunks``) is
done -> SUCCESS. Abort / TransferFailed / PeerFailed / a failed checksum / an
expired deadline -> FAILED. Every non-terminal state has a deadline in the one
heap. On reaching a terminal state the actor emits effects, runs their
handlers, wakes `wait_terminal` callers and removes the room (it keeps a
tombstone so late events are still absorbed and counted through the hook):

    sender   SUCCESS: ReleasePages              FAILED: ReleasePages + TellPeer | AckAbort
    receiver SUCCESS: DeliverPages              FAILED: TellPeer + QuarantinePages, then
                                                ReleasePages on AbortAcked or drain deadline
    both: RoomTerminal last.

A failed receiver stays in the table (state FAILED, quarantined) until its
pages are released: that is I5, and the release is an explicit effect so a
page ledger can check it. Without an ack the drain deadline is `drain_s` when
the peer is dead, else late enough that the (possibly uninformed) sender room
has ended: `created + bootstrap_s + bound_s + drain_s`. TellPeer is not
sent back to a peer that told us (Abort(from_peer=True)) or died
(PeerFailed); a sender aborted by its peer emits AckAbort instead, which the
transport executes once its WRITEs drain; a prefill tombstone that gets a
peer's Abort emits AckAbort too (the abort raced the sender's own end).

`post` does not yield while the mailbox has room (like `asyncio.Queue.put`):
a task switch per event would cost more than applying it.

Handler exceptions are logged and counted (`effect_errors`), never raised
into the loop; bugs in the actor itself do raise, and crash the caller's
task group as they should.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from pdengine.fsm.core import ActorCounters, RoomCore, RoomResult
from pdengine.fsm.events import Event

__all__ = ["ActorCounters", "MailboxFull", "RoomActor", "RoomResult"]


class MailboxFull(RuntimeError):
    """`post_nowait` found the actor's bounded mailbox full (backpressure)."""


class RoomActor(RoomCore):
    """`RoomCore` plus its bounded mailbox, its loop and `wait_terminal`."""

    def __init__(self, *, mailbox_size: int = 4096, **core: Any) -> None:
        if mailbox_size < 1:
            raise ValueError(f"mailbox_size must be >= 1, got {mailbox_size}")
        super().__init__(**core)
        self._send, self._recv = anyio.create_memory_object_stream[Event](mailbox_size)
        self._tg: anyio.abc.TaskGroup | None = None
        self._waiters: dict[int, list[Any]] = {}  # room_id -> [anyio.Event, RoomResult | None]

    async def __aenter__(self) -> RoomActor:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self.run)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None
        if exc_info[0] is not None:
            self._tg.cancel_scope.cancel()
        self.close()
        try:
            return await self._tg.__aexit__(*exc_info)
        finally:
            self._tg = None

    def close(self) -> None:
        """Stop accepting events; `run()` returns once the mailbox is drained."""
        self._send.close()

    async def post(self, event: Event) -> None:
        """Queue `event`; waits only while the mailbox is full (like `asyncio.Queue.put`)."""
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            await self._send.send(event)

    def post_nowait(self, event: Event) -> None:
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            raise MailboxFull(f"room actor mailbox full ({self.mailbox_depth} events)") from None

    @property
    def mailbox_depth(self) -> int:
        return self._recv.statistics().current_buffer_used

    async def wait_terminal(self, room_id: int) -> RoomResult:
        """Wait until the room is terminal. Works before its CreateRoom was applied."""
        done = self._results.get(room_id)
        if done is not None:
            return done[0]
        waiter = self._waiters.get(room_id)
        if waiter is None:
            waiter = self._waiters[room_id] = [anyio.Event(), None]
        await waiter[0].wait()
        return waiter[1]

    # ---- the loop -------------------------------------------------------------
    async def run(self) -> None:
        recv, batch = self._recv, 0
        while True:
            try:
                event = recv.receive_nowait()
            except anyio.WouldBlock:
                self.expire_due()
                nxt = self._heap.next_time()
                event = None
                try:
                    if nxt is None:
                        event = await recv.receive()
                    else:
                        with anyio.move_on_after(max(0.0, nxt - self._clock())):
                            event = await recv.receive()
                except anyio.EndOfStream:
                    return
                if event is None:
                    continue
                batch = 0
            except anyio.EndOfStream:
                return
            self.apply(event)
            batch += 1
            if batch >= 256:  # a full mailbox must not starve the rest of the worker
                batch = 0
                self.expire_due()
                await anyio.lowlevel.checkpoint()

    def gauges(self) -> dict[str, Any]:
        return {**super().gauges(), "mailbox": self.mailbox_depth}

    def _terminal_reached(self, result: RoomResult) -> None:
        waiter = self._waiters.pop(result.room_id, None)
        if waiter is not None:
            waiter[1] = result
            waiter[0].set()
