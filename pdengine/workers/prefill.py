"""PrefillWorker: computes prompts in chunks and pushes their KV pages to decode workers.

A room's life on the prefill side (every state lives in the room actor, I3):

1. `prefill(room_id, prompt, params)` (the router's `/generate`) posts
   `CreateRoom` -> BOOTSTRAPPING, armed with the *bootstrap* deadline. The
   room waits in the bootstrap queue for the decode side.
2. The decode worker registers once per peer (`register_peer`: its NIXL agent
   metadata and pool descriptors, over the token-guarded internal endpoint)
   and sends the room's destination pages (`add_destination`) -> `Bootstrapped`
   -> WAITING_FOR_INPUT (*waiting-for-input* deadline). A destination that
   arrives before the room exists is held until `prefill` creates the room
   (and dropped after the bootstrap deadline).
3. The compute loop admits bootstrapped rooms to the prefill-only scheduler,
   runs chunked prefill steps in the compute thread, and after each step
   WRITEs the pages each chunk completed (`ChunkSent` -> TRANSFERRING, the
   *transfer-progress* deadline restarts per chunk). The last chunk carries
   the aux record: first sampled token, prompt length, earlier checksums.
4. The transport turns WRITE completions into `ChunkDone`; once every chunk
   up to the last is done the actor moves the room to SUCCESS (inflight queue
   empty for it) and the compute loop releases the prompt pages.
5. Abort from decode (an ABORT notification) -> `Abort(from_peer=True)` ->
   FAILED: the loop stops computing the room, the transport fences it (no more
   WRITEs) and sends the abort-ack once its in-flight WRITEs drained (I5).
   Any local failure (deadline, WRITE error, peer death) -> FAILED and
   `TellPeer` makes the transport tell the decode side at once (I6).
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdengine.fsm import AckAbort, RoomState, RoomTerminal, TellPeer
from pdengine.fsm.events import (
    Abort,
    Bootstrapped,
    ChunkDone,
    ChunkSent,
    CreateRoom,
    Event,
    TransferFailed,
)
from pdengine.runtime import SeqStatus, Sequence, StepOutput
from pdengine.runtime.scheduler import ChunkProgress
from pdengine.telemetry.metrics import Metrics
from pdengine.transport import AuxRecord
from pdengine.types import InvalidRequestError, OverloadedError, RequestFailedError, SamplingParams
from pdengine.workers.common import WorkerCore, WorkerOptions

log = logging.getLogger(__name__)

_IDLE_WAKE_S = 0.05


@dataclass
class _Job:
    room_id: int
    seq: Sequence
    admitted: bool = False
    chunks_posted: int = 0
    checksums: list[int] = field(default_factory=list)
    bytes_posted: int = 0
    first_post: float = 0.0
    terminal: bool = False


def _aux_extra(seq: Sequence) -> dict[str, Any]:
    """What decode needs to continue exactly as one engine would, JSON-safe: the first
    token's logprobs (when asked for) and the seeded generator's state after that draw."""
    extra: dict[str, Any] = {}
    if seq.logprobs:
        extra["first_logprobs"] = [[int(t), float(lp)] for t, lp in seq.logprobs[-1].items()]
    if seq.generator is not None:
        state = seq.generator.get_state().numpy().tobytes()
        extra["rng_state"] = base64.b64encode(state).decode()
    return extra


class _BeforeRoom:
    """What the decode side said about a room before the router's prefill call created it
    (its destination pages, or its abort). Entries older than `ttl_s` are forgotten."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.destinations: dict[int, tuple[str, tuple[int, ...], float]] = {}
        self.aborts: dict[int, tuple[str, float]] = {}

    def _prune(self) -> float:
        now = time.monotonic()
        for table in (self.destinations, self.aborts):
            for rid in [r for r, entry in table.items() if entry[-1] < now - self.ttl_s]:
                del table[rid]
        return now

    def add_destination(self, room_id: int, peer: str, pages: list[int]) -> None:
        self.destinations[room_id] = (peer, tuple(pages), self._prune())

    def add_abort(self, room_id: int, reason: str) -> None:
        self.destinations.pop(room_id, None)
        self.aborts[room_id] = (reason, self._prune())

    def take(self, room_id: int) -> tuple[tuple[str, tuple[int, ...], float] | None, str | None]:
        self._prune()
        aborted = self.aborts.pop(room_id, None)
        return self.destinations.pop(room_id, None), None if aborted is None else aborted[0]


class PrefillWorker(WorkerCore):
    role = "prefill"

    def __init__(self, model_ref: str, options: WorkerOptions, metrics: Metrics | None = None,
                 loaded: tuple[Any, Any] | None = None) -> None:
        super().__init__(model_ref, options, metrics, loaded)
        self._jobs: dict[int, _Job] = {}  # compute-side records; room state is in the actor
        self._before = _BeforeRoom(self.options.deadlines.bootstrap_s)
        self.actor.on(RoomTerminal, self._on_room_terminal)
        self.actor.on(TellPeer, self._tell_peer)
        self.actor.on(AckAbort, self._ack_abort)
        self._transition_listeners.append(self._wake_on_bootstrap)
        self.counters = {"prefilled": 0, "writes": 0, "succeeded": 0, "failed": 0}

    @classmethod
    def create(cls, model: str = "tiny", transport: str = "nixl", *, metrics: Metrics | None = None,
               loaded: tuple[Any, Any] | None = None, **cfg: Any) -> PrefillWorker:
        return cls(model, WorkerOptions(transport=transport, **cfg), metrics, loaded)

    # ---- internal endpoints ---------------------------------------------------------------

    async def register_peer(self, peer: str, agent_metadata: bytes, url: str | None = None
                            ) -> None:
        name = self._add_peer(agent_metadata, url)
        if peer and name != peer:
            log.info("peer registered as %r but its agent is named %r", peer, name)

    async def add_destination(self, room_id: int, peer: str, dst_pages: list[int]) -> None:
        """The decode side's pages for a room (the end of the bootstrap)."""
        if not self.is_registered(peer):
            raise InvalidRequestError("peer", f"{peer!r} is not registered")
        done = self.actor.result(room_id)
        if done is not None:  # e.g. its bootstrap deadline fired: tell decode now, not at its own
            raise RequestFailedError(f"room {room_id} already ended on prefill: "
                                     f"{done.state.name} {done.reason}".rstrip())
        if room_id in self._jobs:
            await self.actor.post(Bootstrapped(room_id, peer=peer, dst_pages=tuple(dst_pages)))
        else:
            self._before.add_destination(room_id, peer, dst_pages)

    # ---- router API -----------------------------------------------------------------------

    async def prefill(self, room_id: int, prompt_token_ids: list[int], params: SamplingParams
                      ) -> dict[str, Any]:
        """Prefill `room_id` and push its KV; returns once the room is terminal."""
        self._require_running()
        if room_id in self._jobs or self.actor.result(room_id) is not None:
            raise InvalidRequestError("bootstrap_room", f"room {room_id} is already in use")
        ids = list(prompt_token_ids)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        early, aborted = self._before.take(room_id)
        if aborted is not None:
            raise RequestFailedError(f"room {room_id} was aborted by decode before its "
                                     f"prefill arrived: {aborted}")
        seq = Sequence(f"room-{room_id}", ids, params)
        try:
            self.actor.post_nowait(CreateRoom(room_id, "prefill", meta={"prompt_len": len(ids)}))
        except RuntimeError as exc:  # MailboxFull
            raise OverloadedError(str(exc)) from exc
        self._jobs[room_id] = _Job(room_id, seq)
        self.wake_transport()
        if early is not None:
            self.actor.post_nowait(Bootstrapped(room_id, peer=early[0], dst_pages=early[1]))
        try:
            result = await self.wait_room(room_id)
        except BaseException:
            self.abort(room_id, "prefill request cancelled")
            raise
        out = {"room_id": room_id, "state": result.state.name, "reason": result.reason}
        if result.state is not RoomState.SUCCESS:
            raise RequestFailedError(f"room {room_id} failed on prefill: {result.reason}")
        return out

    def abort(self, room_id: int, reason: str = "aborted") -> None:
        """Abort a room; one whose prefill call has not arrived yet fails when it does."""
        if room_id in self._jobs:
            if self.actor.result(room_id) is None:  # live, or its CreateRoom is still queued
                self.actor.post_nowait(Abort(room_id, reason=reason))
        elif self.actor.result(room_id) is None:
            self._before.add_abort(room_id, reason)

    # ---- effects (run by the actor; must not block) -------------------------------------

    def _tell_peer(self, effect: TellPeer) -> None:
        self.transport.fail(effect.peer, effect.room_id, effect.reason)

    def _ack_abort(self, effect: AckAbort) -> None:
        """Nothing to send here: the transport fenced the room when the ABORT arrived and
        acknowledges it itself once the room's in-flight WRITEs drained."""

    def _on_room_terminal(self, effect: RoomTerminal) -> None:
        job = self._jobs.get(effect.room_id)
        if job is not None:
            job.terminal = True
            if effect.state is RoomState.SUCCESS:
                self.counters["succeeded"] += 1
                if job.first_post:
                    latency_ms = (time.monotonic() - job.first_post) * 1000.0
                    self.metrics.observe_kv_transfer(latency_ms, job.bytes_posted)
            else:
                self.counters["failed"] += 1
        self.wake()

    def _wake_on_bootstrap(self, room: Any, src: RoomState, dst: RoomState) -> None:
        if dst is RoomState.WAITING_FOR_INPUT:
            self.wake()

    # ---- compute loop -------------------------------------------------------------------

    async def _compute_loop(self) -> None:
        while True:
            self._admit_and_reap()
            out = await self._step()
            if out is None:
                await self._wait_wake(_IDLE_WAKE_S)
                continue
            await self._after_step(out)

    def _admit_and_reap(self) -> None:
        """Admit bootstrapped rooms; drop the sequences of terminal rooms (frees their pages)."""
        for job in list(self._jobs.values()):
            if job.terminal:
                self._drop(job)
            elif not job.admitted and self.room_state(job.room_id) is RoomState.WAITING_FOR_INPUT:
                room = self.actor.get(job.room_id)
                need = self.pool.layout.pages_for(job.seq.num_prompt_tokens)
                if room is not None and len(room.dst_pages) < need:
                    self.actor.post_nowait(TransferFailed(
                        job.room_id,
                        f"decode sent {len(room.dst_pages)} destination pages; the prompt of "
                        f"{job.seq.num_prompt_tokens} tokens needs {need}",
                    ))
                    job.admitted = True  # never computed; dropped when the failure lands
                    continue
                self.scheduler.add(job.seq)
                job.admitted = True

    def _drop(self, job: _Job) -> None:
        seq = job.seq
        if seq.status is SeqStatus.PREFILLED:
            self.scheduler.release(seq)
        elif seq.status is not SeqStatus.FINISHED:
            self.scheduler.abort(seq)
        self.transport.forget_room(job.room_id)
        del self._jobs[job.room_id]

    async def _after_step(self, out: StepOutput) -> None:
        self.counters["prefilled"] += len(out.prefilled)
        for chunk in out.chunks:
            room_id = int(chunk.seq.request_id.removeprefix("room-"))
            job = self._jobs.get(room_id)
            room = self.actor.get(room_id)
            if job is None or room is None or room.state.terminal or job.terminal:
                continue
            await self._write_chunk(job, room, chunk)

    async def _write_chunk(self, job: _Job, room: Any, chunk: ChunkProgress) -> None:
        if not chunk.pages and not chunk.is_last:
            return  # this chunk completed no page; its tokens travel with the next one
        dst = [room.dst_pages[i] for i in chunk.page_indices]
        aux = None
        if chunk.is_last:
            aux = AuxRecord(
                first_token=job.seq.token_ids[-1],
                prompt_len=job.seq.num_prompt_tokens,
                chunk_checksums=tuple(job.checksums),
                extra=_aux_extra(job.seq),
            )
        index = job.chunks_posted
        await self.actor.post(ChunkSent(job.room_id, index))
        checksum = self.transport.write_pages(
            room.peer, job.room_id, index, chunk.is_last, chunk.pages, dst, aux
        )
        if checksum is None:
            return  # fenced by an abort: the actor already has (or will get) it
        self.wake_transport()
        if not job.first_post:
            job.first_post = time.monotonic()
        job.chunks_posted += 1
        job.checksums.append(checksum)
        job.bytes_posted += len(chunk.pages) * self.pool.layout.page_nbytes
        self.counters["writes"] += 1

    def _observe_event(self, event: Event) -> None:
        if isinstance(event, ChunkDone) and event.is_last:
            self.wake()
        elif (isinstance(event, Abort) and event.room_id not in self._jobs
              and self.actor.result(event.room_id) is None):  # decode gave up before the room
            self._before.add_abort(event.room_id, event.reason)

    def _on_stop(self) -> None:
        for job in list(self._jobs.values()):
            self._drop(job)

    # ---- introspection ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        rooms = self._room_gauges()
        by_state = rooms["rooms"]
        return {
            **rooms,
            "num_prefill_bootstrap_queue_reqs": by_state.get("BOOTSTRAPPING", 0),
            "num_prefill_inflight_queue_reqs": by_state.get("TRANSFERRING", 0),
            "num_queue_reqs": len(self.scheduler.waiting)
            + sum(1 for j in self._jobs.values() if not j.admitted and not j.terminal),
            "num_running_reqs": len(self.scheduler.running),
            "early_destinations": len(self._before.destinations),
            "early_aborts": len(self._before.aborts),
            "jobs": len(self._jobs),
            "peers": len(self._peer_urls),
            **self.counters,
        }
