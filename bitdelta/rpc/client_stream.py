"""Client-streaming calls whose refusals reach the client with their real status.

grpc's asyncio client loses the server's status when the server ends a client-streaming call
while the client still has a message in flight: the failed write overwrites the status with
INTERNAL "Internal error from Core" (grpc/grpc#36066). Every upload refused early (a name that
exists, a header that is not a delta, a missing token) could show up that way. The handshake
below makes sure no message is in flight when a status is sent:

- the client sends its first message (the header) and waits for the response headers;
- the server answers them with `accepted` (`ClientStream.accept`), and the client streams
  the rest; or with `refused`, and the client half-closes at once;
- a refused call is answered with its status only after the client half-closed: the server
  drops what is still coming (`ClientStream.refuse`), at most the bytes the header announced,
  so a client that does not wait for the answer gets its status as well.

The server skeleton (`bitdelta.rpc.serve`) gives every client-streaming method a `ClientStream`
and calls `refuse()` for any exception; the servicer calls `accept()` once the header passed its
checks. `call_with_handshake` is the client half.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

HANDSHAKE_KEY = "bitdelta-client-stream"
ACCEPTED, REFUSED = "accepted", "refused"
DEFAULT_DRAIN_BYTES = 64 << 20  # one largest message; more once the servicer knows what was announced
DRAIN_TIMEOUT_S = 10.0  # a refused call holds its handler at most this long for the client to finish


class ClientStream:
    """The server's side of one client-streaming call: iterate it for the messages."""

    def __init__(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext):
        self._requests, self._context = requests, context
        self._answered = False
        self.drain_limit_bytes = DEFAULT_DRAIN_BYTES

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._requests.__aiter__()

    async def first(self) -> Any | None:
        """The first message, or None when the client sent none."""
        return await anext(aiter(self._requests), None)

    def announced(self, nbytes: int) -> None:
        """The client said it will send `nbytes` bytes after its header: a refusal drains that much."""
        self.drain_limit_bytes = max(DEFAULT_DRAIN_BYTES, nbytes + DEFAULT_DRAIN_BYTES // 64)

    async def accept(self) -> None:
        """Tell the client to send the rest."""
        await self._answer(ACCEPTED)

    async def refuse(self) -> None:
        """Before the status goes out: tell the client to stop, then drop what it still sends until
        it half-closes (or sent more than `drain_limit_bytes`, or took longer than DRAIN_TIMEOUT_S,
        or went away: a client that neither waits nor finishes gets the status regardless)."""

        async def drain() -> None:
            await self._answer(REFUSED)
            seen = 0
            async for m in self._requests:
                seen += len(m) if isinstance(m, bytes) else m.ByteSize()
                if seen > self.drain_limit_bytes:
                    return

        try:
            await asyncio.wait_for(drain(), DRAIN_TIMEOUT_S)
        except Exception:
            return

    async def _answer(self, value: str) -> None:
        if not self._answered:
            self._answered = True
            await self._context.send_initial_metadata(((HANDSHAKE_KEY, value),))


async def call_with_handshake(call: grpc.aio.StreamUnaryCall, first: Any, rest: AsyncIterator[Any]) -> Any:
    """The client half: send `first` on `call` (made without a request iterator), then `rest` once
    the server accepted; returns the response (AioRpcError with the server's status otherwise).

        call = stub.Put(timeout=60)
        response = await call_with_handshake(call, header, pieces())
    `rest` is not started when the server refuses (a file it would read is never opened)."""
    try:
        try:
            await call.write(first)
            metadata = await call.initial_metadata()
            if not call.done() and dict(metadata or ()).get(HANDSHAKE_KEY) == ACCEPTED:
                async for r in rest:
                    await call.write(r)
            await call.done_writing()
        except asyncio.InvalidStateError:  # the call ended: its status says why
            pass
        return await call
    except grpc.aio.AioRpcError:
        raise
    except BaseException:
        call.cancel()
        raise
