"""PDEngine: a prefill and a decode worker in one process, behind the colocated Engine's API.

Lifecycle:
- `__aenter__` loads the model once (in a thread), builds a PrefillWorker and a
  DecodeWorker over their own KV pools (loopback transport by default,
  `transport="nixl"` for real NIXL between the two pools), connects the decode
  worker to the prefill worker in-process, and runs both in one task group.
- `stream()` / `generate()` give each request a random 63-bit room id and
  start both halves concurrently, like the router does: the prefill half
  (`PrefillWorker.prefill`) as a task, the decode half (`DecodeWorker.stream`)
  as the caller's delta stream.
- `abort(request_id)` aborts the decode side, which tells the prefill side (I6)
  and quarantines its pages until the abort-ack (I5).
- `__aexit__` cancels both workers; open requests fail with RequestFailedError.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import anyio
import anyio.abc

from pdengine.config import Deadlines, SchedulerConfig
from pdengine.engine.base import EngineBase, RequestStream
from pdengine.model import load_model
from pdengine.transport import FaultConfig
from pdengine.types import InvalidRequestError, PDEngineError, SamplingParams
from pdengine.workers import DecodeWorker, LivenessConfig, PrefillWorker

log = logging.getLogger(__name__)

_LOCAL_PREFILL = "inproc://prefill"
TRANSPORTS = ("loopback", "nixl")


class PDEngine(EngineBase):
    def __init__(
        self,
        model: str = "tiny",
        *,
        transport: str = "loopback",
        scheduler_config: SchedulerConfig | None = None,
        deadlines: Deadlines | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        checksums: bool = True,
        prefill_faults: FaultConfig | None = None,
        decode_faults: FaultConfig | None = None,
        seed: int | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise InvalidRequestError(
                "transport", f"must be one of {TRANSPORTS}, not {transport!r}"
            )
        self.model_name = str(model)
        self._model_ref = model
        self._transport = transport
        self._config = scheduler_config or SchedulerConfig()
        self._deadlines = deadlines or Deadlines()
        self._dtype = dtype
        self._device = device
        self._checksums = checksums
        # transport faults (tests, chaos): WRITE faults act on the sender, notification
        # faults and corruption on the receiver
        self._prefill_faults = prefill_faults
        self._decode_faults = decode_faults
        self._rng = random.Random(seed)
        self._tg: anyio.abc.TaskGroup | None = None
        self._rooms: dict[str, int] = {}  # request id -> room id while its prefill half runs
        self.prefill: PrefillWorker | None = None
        self.decode: DecodeWorker | None = None

    async def _start(self) -> None:
        loaded = await anyio.to_thread.run_sync(
            lambda: load_model(self._model_ref, dtype=self._dtype, device=self._device)
        )
        common: dict[str, Any] = {
            "scheduler": self._config,
            "deadlines": self._deadlines,
            "liveness": LivenessConfig(),
            "checksums": self._checksums,
            "dtype": self._dtype,
            "device": self._device,
        }
        self.prefill = PrefillWorker.create(
            self._model_ref, self._transport, loaded=loaded, faults=self._prefill_faults, **common
        )
        self.decode = DecodeWorker.create(
            self._model_ref, self._transport, loaded=loaded, faults=self._decode_faults, **common
        )
        self.decode.connect_local(_LOCAL_PREFILL, self.prefill)
        self.tokenizer = self.decode.tokenizer
        self.vocab_size = self.decode.vocab_size
        self.max_model_len = self.decode.max_model_len
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        await self._tg.start(self.prefill.run)
        await self._tg.start(self.decode.run)

    async def _stop(self) -> None:
        if self._tg is None:
            return
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)

    def _submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
                ) -> RequestStream:
        if self._tg is None or self.prefill is None or self.decode is None:
            raise RuntimeError("use the engine inside `async with`")
        self.prefill.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)
        room_id = self._rng.getrandbits(63)
        stream = self.decode.stream(
            room_id, prompt_token_ids, params, _LOCAL_PREFILL, request_id=request_id
        )
        self._rooms[request_id] = room_id
        self._tg.start_soon(self._prefill_half, room_id, prompt_token_ids, params, request_id)
        return RequestStream(request_id, prompt_token_ids, stream.detach(), self.abort)

    async def _prefill_half(self, room_id: int, ids: list[int], params: SamplingParams,
                            request_id: str) -> None:
        assert self.prefill is not None
        try:
            await self.prefill.prefill(room_id, ids, params)
        except PDEngineError as exc:  # the decode half reports it to the caller
            log.debug("prefill of %s (room %s) ended: %s", request_id, room_id, exc)
        finally:
            self._rooms.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        room_id = self._rooms.get(request_id)
        if room_id is not None and self.prefill is not None:
            self.prefill.abort(room_id, "aborted by the client")  # even before its prefill ran
        return self.decode is not None and self.decode.abort_request(request_id, "aborted")

    def stats(self) -> dict[str, Any]:
        if self.prefill is None or self.decode is None:
            return {}
        p, d = self.prefill.stats(), self.decode.stats()
        return {
            "running": d["num_running_reqs"],
            "waiting": d["num_queue_reqs"] + p["num_queue_reqs"] + p["num_running_reqs"],
            "pages_used": p["pages_used"] + d["pages_used"],
            "pages_free": p["pages_free"] + d["pages_free"],
            "prefill": p,
            "decode": d,
        }
