"""RequestStream: the async iterator a caller reads one request's deltas from.

Shared by the colocated engine, the PD engine and the decode worker. The last
delta has a `finish_reason`; a failed request raises its typed error. Leaving
early — `aclose()`, `break` (once the iterator is collected) or cancelling the
reading task — calls `abort(request_id)`, which aborts the request (and, in PD,
the room on both workers).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from pdengine.types import StreamDelta


class RequestStream:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        receive: MemoryObjectReceiveStream[StreamDelta | BaseException],
        abort: Callable[[str], object],
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._receive = receive
        self._abort = abort
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            self._close()
            raise StopAsyncIteration from None
        except BaseException:
            self._close(abort=True)
            raise
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finish_reason is not None:
            self._close()
        return item

    async def aclose(self) -> None:
        self._close(abort=True)

    def detach(self) -> MemoryObjectReceiveStream[StreamDelta | BaseException]:
        """Hand the raw delta stream to another wrapper (which then owns abort-on-close)."""
        self._done = True
        return self._receive

    def _close(self, abort: bool = False) -> None:
        if not self._done:
            self._done = True
            if abort:
                self._abort(self.request_id)
            self._receive.close()

    def __del__(self) -> None:
        if not self._done:
            self._close(abort=True)
