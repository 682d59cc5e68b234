"""What every client shares: one channel made in one place, deadlines, errors with the callee's code.

    class WorkerClient(Client):
        SERVICE = "worker"
        ERROR = WorkerCallError
        def __init__(self, target, *, timeout_s=10.0):
            super().__init__(target, timeout_s=timeout_s)
            self._stub = pb_grpc.GpuWorkerServiceStub(self.channel)

        async def status(self, timeout_s=None):
            return await self._unary(self._stub.Status, pb.StatusRequest(), "Status", timeout_s)

`open_channel` is the one place a channel is made (message limits, the client interceptors
that carry the trace context); `_unary` and `_stream` give every call a deadline and turn a
failed call into `ERROR` (or the subclass `ERROR_TYPES` names for its code), keeping the code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

import grpc

from bitdelta.rpc.errors import RpcError, from_aio_error
from bitdelta.rpc.security import bearer_interceptors
from bitdelta.rpc.telemetry import client_interceptors

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# gRPC's reconnect backoff grows to 120 s by default: a worker whose store was down for a minute would
# answer UNAVAILABLE ("Connection refused", the channel's cached error) for up to two minutes after
# the store came back. Capped, a channel retries a lost peer every few seconds (a cheap TCP connect).
# Only the delays between attempts: gRPC's `min_reconnect_backoff_ms` is the time ONE attempt may take
# to connect (20 s by default); set to 250 ms it failed a connect whose handshake was merely slow (a
# TLS handshake on a busy host, a peer paused for a moment: "timed out before receiving SETTINGS frame").
RECONNECT_BACKOFF_MS = (250, 2000)  # first, most


def open_channel(
    target: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    credentials: grpc.ChannelCredentials | None = None,
    token: str = "",
) -> grpc.aio.Channel:
    """A channel to `target` with the project's options and client interceptors; TLS with
    `credentials` (`TlsSettings.channel_credentials`), else plain text; with `token`, every call
    carries `authorization: Bearer <token>` (bitdelta.rpc.security)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    interceptors = [*client_interceptors(), *(bearer_interceptors(token) if token else ())]  # trace context first
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


class Client:
    """One channel to one service; share it. Use `async with` or call `close()`."""

    SERVICE: ClassVar[str] = "service"  # how messages name the callee, e.g. "worker"
    ERROR: ClassVar[type[RpcError]] = RpcError
    ERROR_TYPES: ClassVar[Mapping[grpc.StatusCode, type[RpcError]]] = {}
    MAX_MESSAGE_BYTES: ClassVar[int] = DEFAULT_MAX_MESSAGE_BYTES

    def __init__(
        self, target: str, *, timeout_s: float, credentials: grpc.ChannelCredentials | None = None, token: str = ""
    ):
        self.target, self.timeout_s = target, timeout_s
        self.tls = credentials is not None
        self.channel = open_channel(target, self.MAX_MESSAGE_BYTES, credentials, token)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _error(self, e: grpc.aio.AioRpcError, what: str) -> RpcError:
        """`ERROR_TYPES[code]` or `ERROR`, with the callee's code, details and trailers."""
        cls = self.ERROR_TYPES.get(e.code(), self.ERROR)
        err = from_aio_error(e, f"{self.SERVICE} {self.target}", what)
        hint = self._hint(err)
        return cls(str(err) + hint, err.code, service=err.service, details=err.details + hint, trailers=err.trailers)

    def _hint(self, err: RpcError) -> str:
        """What a connection closed during set-up ("failed to connect ...: Socket closed") usually
        means: the callee accepted the connection and closed it, because the two sides disagree on
        TLS. A callee that dies during a call ("Stream removed (Socket closed)") gets no hint."""
        d = err.details.rstrip()
        if err.code != grpc.StatusCode.UNAVAILABLE or "failed to connect" not in d or not d.endswith("Socket closed"):
            return ""
        if self.tls:
            return (
                f" (the {self.SERVICE} closed the connection during set-up: it may require a client "
                "certificate signed by its CA, which this client does not present)"
            )
        return (
            f" (the {self.SERVICE} closed the connection during set-up: it may require TLS, and this "
            "client connects in plain text)"
        )

    async def _unary(
        self, method, request, what: str, timeout_s: float | None, metadata: Sequence[tuple[str, str]] = ()
    ) -> Any:
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=tuple(metadata) or None)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, what) from None

    async def _stream(
        self, method, request, what: str, timeout_s: float, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[Any]:
        """The responses of a server-streaming call; leaving the loop early (or being cancelled)
        cancels the call, so the callee stops its work."""
        call = method(request, timeout=timeout_s, metadata=tuple(metadata) or None)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise self._error(e, what) from None
        finally:
            call.cancel()
