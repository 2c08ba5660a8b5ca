"""DecodeWorker: receives a prompt's KV pages from a prefill worker, then decodes and streams.

A request's life on the decode side (room state lives in the room actor, I3):

1. `stream(room_id, prompt, params, prefill_url)` checks the request, then a
   setup task allocates the destination pages. While the pool is short the
   request waits in the prealloc queue (bounded by the bootstrap deadline).
2. It registers with the prefill worker once per peer (NIXL agent metadata and
   pool descriptors over the token-guarded internal endpoint; both sides load
   each other's agent), posts `CreateRoom` with the pages (BOOTSTRAPPING,
   *bootstrap* deadline) and sends the destination pages. Accepted ->
   `Bootstrapped` -> WAITING_FOR_INPUT (*waiting-for-input* deadline).
3. The transport verifies each arriving chunk's checksum and posts
   `ChunkDone` (TRANSFERRING; the *transfer-progress* deadline restarts per
   chunk, capped by a total). The last chunk brings the aux record; the actor
   moves the room to SUCCESS and its `DeliverPages` effect hands the pages and
   the first token to the compute loop, which joins the running batch
   (`Scheduler.add_prefilled`) and streams deltas.
4. Client abort (closing the stream, `abort`) or any failure (deadline,
   checksum, peer death, prefill failure) -> FAILED: `TellPeer` sends ABORT to
   the prefill side at once (I6) and `QuarantinePages` keeps the pages out of
   the pool until the prefill side's abort-ack or the *drain* deadline, when
   `ReleasePages` frees them (I5). The client gets `RequestFailedError` with
   the reason (or a final "abort" delta when it aborted), never a hang.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectSendStream

from pdengine.fsm import DeliverPages, ReleasePages, RoomState, TellPeer
from pdengine.fsm.events import Abort, Bootstrapped, CreateRoom, TransferFailed
from pdengine.runtime import OutputText, SeqStatus, Sequence, StepOutput
from pdengine.runtime.request_stream import RequestStream as DecodeStream
from pdengine.telemetry.metrics import Metrics
from pdengine.types import (
    InvalidRequestError,
    PDEngineError,
    RequestFailedError,
    SamplingParams,
    StreamDelta,
)
from pdengine.workers.common import WorkerCore, WorkerOptions
from pdengine.workers.peer_client import PeerError

log = logging.getLogger(__name__)

_PREALLOC_POLL_S = 0.01
_IDLE_WAKE_S = 0.05


@dataclass
class _Job:
    room_id: int
    seq: Sequence
    prefill_url: str
    send: MemoryObjectSendStream[StreamDelta | BaseException]
    started: float
    phase: str = "prealloc"  # prealloc | bootstrap | transfer | decoding | done
    pages: list[int] | None = None  # held before the room exists (then the actor decides)
    room_created: bool = False
    aborted: str = ""
    scope: anyio.CancelScope | None = None
    text_sent: int = 0
    logprobs_sent: int = 0
    last_token_at: float = 0.0


def _aux_problem(aux: dict[str, Any], prompt_len: int) -> str:
    """Why the last chunk's aux record cannot start decoding, or "" when it can."""
    if "first_token" not in aux:
        return "the transfer ended without its aux record"
    if aux.get("prompt_len") != prompt_len:
        return f"prefill computed {aux.get('prompt_len')} prompt tokens, not {prompt_len}"
    return ""


def _send(job: _Job, item: StreamDelta | BaseException) -> None:
    """Hand an item to the request's reader; a reader that went away is not an error."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        job.send.send_nowait(item)


class DecodeWorker(WorkerCore):
    role = "decode"

    def __init__(self, model_ref: str, options: WorkerOptions, metrics: Metrics | None = None,
                 loaded: tuple[Any, Any] | None = None) -> None:
        super().__init__(model_ref, options, metrics, loaded)
        self._jobs: dict[int, _Job] = {}
        self._by_request: dict[str, int] = {}
        self._deliveries: list[DeliverPages] = []
        self._registered: dict[str, str] = {}  # prefill URL -> its transport peer name
        self._register_locks: dict[str, anyio.Lock] = {}
        self._local_peers: dict[str, Any] = {}  # in-process prefill workers by pseudo-URL
        self.actor.on(DeliverPages, self._on_deliver)
        self.actor.on(ReleasePages, self._on_release)
        self.actor.on(TellPeer, self._tell_peer)
        self.counters = {"finished": 0, "aborted": 0, "failed": 0}

    @classmethod
    def create(cls, model: str = "tiny", transport: str = "nixl", *, metrics: Metrics | None = None,
               loaded: tuple[Any, Any] | None = None, **cfg: Any) -> DecodeWorker:
        return cls(model, WorkerOptions(transport=transport, **cfg), metrics, loaded)

    def connect_local(self, url: str, prefill_worker: Any) -> None:
        """Reach an in-process PrefillWorker at pseudo-URL `url` (embedded PD engine)."""
        self._local_peers[url] = prefill_worker

    # ---- public API ---------------------------------------------------------------------

    def stream(self, room_id: int, prompt_token_ids: list[int], params: SamplingParams,
               prefill_url: str, request_id: str | None = None) -> DecodeStream:
        """Start a request; iterate the result for its deltas. Closing it early aborts."""
        tg = self._require_running()
        if room_id in self._jobs or self.actor.result(room_id) is not None:
            raise InvalidRequestError("bootstrap_room", f"room {room_id} is already in use")
        ids = list(prompt_token_ids)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        request_id = request_id or f"room-{room_id}"
        if request_id in self._by_request:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        text = OutputText(self.tokenizer.detokenizer(ids), params.stop)
        seq = Sequence(request_id, ids, params, output_text=text)
        send, receive = anyio.create_memory_object_stream[StreamDelta | BaseException](math.inf)
        job = _Job(room_id, seq, prefill_url, send, time.perf_counter())
        self._jobs[room_id] = job
        self._by_request[request_id] = room_id
        tg.start_soon(self._setup, job, name=f"decode-room-{room_id}")
        return DecodeStream(request_id, ids, receive, lambda _rid: self.abort(room_id))

    def abort(self, room_id: int, reason: str = "aborted") -> bool:
        """Abort wherever the request is; False when it is unknown or already finished."""
        job = self._jobs.get(room_id)
        if job is None or job.aborted:
            return False
        job.aborted = reason
        state = self.room_state(room_id)
        if job.room_created and state is not None and not state.terminal:
            self.actor.post_nowait(Abort(room_id, reason=reason))  # counted by the FSM hook
        else:
            self.metrics.inc_aborted()  # before the room existed, or while decoding
            if not job.room_created and job.scope is not None:
                job.scope.cancel()
        self.wake()  # a decoding request is dropped by the compute loop
        return True

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        room_id = self._by_request.get(request_id)
        return False if room_id is None else self.abort(room_id, reason)

    # ---- setup: pages, registration, destination, transfer --------------------------------

    async def _setup(self, job: _Job) -> None:
        try:
            await self._bootstrap(job)
        except PDEngineError as exc:
            self._end(job, exc)
            return
        if not job.room_created:  # aborted before the room existed: tell prefill if we can
            peer = self._registered.get(job.prefill_url)
            if peer is not None and self.is_registered(peer):
                self.transport.abort(peer, job.room_id, job.aborted)
            self._end(job, None)
            return
        result = await self.actor.wait_terminal(job.room_id)
        if result.state is RoomState.SUCCESS:
            return  # DeliverPages handed the request to the compute loop
        if job.aborted:
            self._end(job, None)
        else:
            self._end(job, RequestFailedError(f"room {job.room_id} failed: {result.reason}"))

    async def _bootstrap(self, job: _Job) -> None:
        rid, url = job.room_id, job.prefill_url
        with anyio.CancelScope() as job.scope:
            try:
                job.pages = pages = await self._allocate(job)
                job.phase = "bootstrap"
                try:
                    peer = await self._ensure_registered(url)
                except (PeerError, PDEngineError) as exc:
                    raise RequestFailedError(f"cannot register with prefill {url}: {exc}") from exc
                await self.actor.post(CreateRoom(rid, "decode", peer=peer, pages=tuple(pages)))
                job.room_created, job.pages = True, None
                self.wake_transport()
            finally:
                if job.pages is not None:  # aborted or failed before the actor took the pages
                    self.pool.allocator.free(job.pages)
                    job.pages = None
        if not job.room_created:
            return
        if job.aborted:
            await self.actor.post(Abort(rid, reason=job.aborted))
            return
        job.phase = "transfer"
        try:
            await self._send_destination(url, rid, pages)
        except (PeerError, PDEngineError) as exc:
            self._registered.pop(url, None)  # e.g. a restarted prefill: register again next time
            await self.actor.post(TransferFailed(rid, f"prefill {url} refused the pages: {exc}"))
        else:
            await self.actor.post(Bootstrapped(rid, peer=peer, dst_pages=tuple(pages)))

    async def _allocate(self, job: _Job) -> list[int]:
        need = self.pool.layout.pages_for(job.seq.num_prompt_tokens)
        give_up = time.monotonic() + self.options.deadlines.bootstrap_s
        while (pages := self.pool.allocator.alloc(need)) is None:
            if time.monotonic() > give_up:
                raise RequestFailedError(
                    f"no {need} free KV pages within {self.options.deadlines.bootstrap_s:g}s"
                )
            await anyio.sleep(_PREALLOC_POLL_S)
        return pages

    async def _ensure_registered(self, url: str) -> str:
        lock = self._register_locks.setdefault(url, anyio.Lock())
        async with lock:
            peer = self._registered.get(url)
            if peer is not None and self.is_registered(peer):
                return peer
            local = self._local_peers.get(url)
            if local is not None:
                await local.register_peer(self.name, self.agent_metadata(), url=None)
                peer = self._add_peer(local.agent_metadata(), None)
            else:
                _, metadata = await self.peer_client.register(
                    url, self.name, self.agent_metadata(), self.options.advertise_url
                )
                peer = self._add_peer(metadata, url)
            self._registered[url] = peer
            return peer

    async def _send_destination(self, url: str, room_id: int, pages: list[int]) -> None:
        local = self._local_peers.get(url)
        if local is not None:
            await local.add_destination(room_id, self.name, pages)
        else:
            await self.peer_client.add_destination(url, room_id, self.name, pages)

    # ---- effects (run by the actor; must not block) -------------------------------------

    def _on_deliver(self, effect: DeliverPages) -> None:
        self._deliveries.append(effect)
        self.wake()

    def _on_release(self, effect: ReleasePages) -> None:
        self.pool.allocator.free(list(effect.pages))

    def _tell_peer(self, effect: TellPeer) -> None:
        self.transport.abort(effect.peer, effect.room_id, effect.reason)

    # ---- compute loop -------------------------------------------------------------------

    async def _compute_loop(self) -> None:
        while True:
            self._apply_deliveries()
            self._apply_aborts()
            out = await self._step()
            if out is None:
                await self._wait_wake(_IDLE_WAKE_S)
                continue
            self._dispatch(out)

    def _apply_deliveries(self) -> None:
        deliveries, self._deliveries = self._deliveries, []
        for effect in deliveries:
            job = self._jobs.get(effect.room_id)
            aux = effect.aux or {}
            problem = _aux_problem(aux, job.seq.num_prompt_tokens) if job else ""
            if job is None or job.aborted or problem:
                self.pool.allocator.free(list(effect.pages))
                if job is not None:
                    error = None if job.aborted else RequestFailedError(
                        f"room {effect.room_id}: {problem}")
                    self._end(job, error)
                continue
            job.phase = "decoding"
            extra = aux.get("extra", {})
            self._restore_rng(job.seq, extra.get("rng_state"))
            out = self.scheduler.add_prefilled(job.seq, list(effect.pages), aux["first_token"])
            first_lps = extra.get("first_logprobs")
            if job.seq.logprobs is not None and first_lps:
                job.seq.logprobs.append({int(t): float(lp) for t, lp in first_lps})
            self._dispatch(out)

    def _restore_rng(self, seq: Sequence, state: str | None) -> None:
        """Continue a seeded request's random stream where the prefill side's draw left it."""
        if state is None or seq.params.seed is None:
            return
        generator = seq.rng(self.pool.device)
        try:
            generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)),
                                                 dtype=torch.uint8))
        except (RuntimeError, ValueError) as exc:  # another device's generator format
            log.warning("room of %s: cannot restore the seeded RNG (%s); reseeding",
                        seq.request_id, exc)
            generator.manual_seed(seq.params.seed)

    def _apply_aborts(self) -> None:
        for job in list(self._jobs.values()):
            if job.aborted and job.phase == "decoding":
                self.scheduler.abort(job.seq)
                self._end(job, None)

    def _dispatch(self, out: StepOutput) -> None:
        for seq, token in out.sampled:
            job = self._jobs.get(self._by_request.get(seq.request_id, -1))
            if job is None:
                continue
            _send(job, self._delta(job, [token]))
            if seq.is_finished:
                self._end(job, None, send_final=False)

    def _delta(self, job: _Job, token_ids: list[int]) -> StreamDelta:
        seq, now = job.seq, time.perf_counter()
        if token_ids:
            if job.last_token_at:
                self.metrics.observe_inter_token(now - job.last_token_at)
            else:
                self.metrics.observe_ttft(now - job.started)
            job.last_token_at = now
        text = seq.text
        holdback = seq.output_text.holdback if seq.output_text is not None else 0
        upto = len(text) if seq.is_finished else max(job.text_sent, len(text) - holdback)
        delta_text, job.text_sent = text[job.text_sent : upto], upto
        lps = None
        if seq.logprobs is not None:
            lps, job.logprobs_sent = seq.logprobs[job.logprobs_sent :], len(seq.logprobs)
        return StreamDelta(seq.request_id, token_ids, delta_text,
                           seq.finish_reason if seq.is_finished else None, lps)

    def _end(self, job: _Job, error: BaseException | None, send_final: bool = True) -> None:
        """The request is over: send its last delta (or error) and forget it."""
        if self._jobs.pop(job.room_id, None) is None:
            return
        self._by_request.pop(job.seq.request_id, None)
        job.phase = "done"
        if error is not None:
            self.counters["failed"] += 1
            _send(job, error)
        else:
            if send_final:
                if not job.seq.is_finished:  # never reached the scheduler: end it here
                    job.seq.status, job.seq.finish_reason = SeqStatus.FINISHED, "abort"
                _send(job, self._delta(job, []))
            self.counters["aborted" if job.seq.finish_reason == "abort" else "finished"] += 1
            self.metrics.observe_e2e(time.perf_counter() - job.started)
        job.send.close()

    def _on_stop(self) -> None:
        for job in list(self._jobs.values()):
            if job.phase == "decoding":
                self.scheduler.abort(job.seq)
            self._end(job, RequestFailedError("the decode worker stopped"))

    # ---- introspection ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        rooms = self._room_gauges()
        by_state = rooms["rooms"]
        phases = [j.phase for j in self._jobs.values()]
        return {
            **rooms,
            "num_decode_prealloc_queue_reqs": phases.count("prealloc"),
            "num_decode_transfer_queue_reqs": sum(
                by_state.get(s, 0) for s in ("BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING")
            ),
            "num_running_reqs": len(self.scheduler.running),
            "num_queue_reqs": len(self.scheduler.waiting),
            "requests_in_flight": len(self._jobs),
            "peers": len(self._peer_urls),
            **self.counters,
        }
