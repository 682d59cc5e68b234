"""The one server skeleton every service runs on.

    server = create_server("127.0.0.1:0", [Service(NAME, lambda s: add_XServicer_to_server(servicer, s))],
                           status_table={FileNotFoundError: grpc.StatusCode.NOT_FOUND})
    await server.start()                      # health SERVING (or `serving=False` until ready)
    print(server.port)                        # port 0 picks a free port (tests)
    await run_until_signal(server, grace_s=10, on_stop=core.close)   # the process

What every service gets:
- `grpc.health.v1` for "" and each service; reflection for all of them.
- ONE interceptor around the domain services' methods (never around health or
  reflection, whose streaming `Watch` must stay untouched): exceptions become
  status codes through `errors.status_of` with clipped messages (a
  `ServiceError` answers with its own code and trailers; `status_table` maps
  only exceptions outside that family), calls in
  flight are counted, and while draining new calls get UNAVAILABLE (except the
  read-only methods named in `open_while_draining`). A `public` server (the
  router: its callers are outside the deployment) names no network address in
  a status message (`errors.without_addresses`; the log keeps the whole
  message). A client-streaming method
  gets a `ClientStream` (`bitdelta.rpc.client_stream`): a refusal reaches the
  client with its real status.
- Traces (`bitdelta.rpc.telemetry`): one SERVER span per domain call, in the caller's trace
  (W3C `traceparent` in the metadata), its status code recorded.
- Drain: health goes NOT_SERVING and the server keeps answering it (a probe
  sees NOT_SERVING, not "failed to connect") while calls in flight finish,
  for at most `grace_s`; then the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from bitdelta.rpc.client_stream import ClientStream
from bitdelta.rpc.errors import (
    NO_TABLE,
    ServiceError,
    StatusTable,
    clip_message,
    metadata_value,
    status_of,
    without_addresses,
)
from bitdelta.rpc.telemetry import ServerInterceptor as TraceInterceptor

log = logging.getLogger("bitdelta.rpc")
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class Service:
    """One gRPC service to serve: its full name and how to add its servicer to a server."""

    name: str  # e.g. "bitdelta.router.v1.RouterService"
    register: Callable[[grpc.aio.Server], None]


class _Calls:
    """Calls in flight (domain methods only) and the drain switch."""

    def __init__(self) -> None:
        self.n = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.n += 1
        self._idle.clear()

    def leave(self) -> None:
        self.n -= 1
        if self.n == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Draining(ServiceError):
    """A new call to a draining server (the client should try another replica)."""

    code = grpc.StatusCode.UNAVAILABLE


class _ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self, services: Iterable[str], table: StatusTable, calls: _Calls, open_while_draining: set[str], public: bool
    ):
        self.prefixes = tuple(f"/{s}/" for s in services)
        self.table, self.calls, self.open, self.public = table, calls, open_while_draining, public

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(self.prefixes):
            return handler  # health, reflection: untouched
        short = method.rsplit("/", 1)[1]
        gate = short not in self.open
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method, gate), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._client_stream(handler.stream_unary, method, gate), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, method, gate), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, method, gate), **kw)

    def _unary(self, fn, method: str, gate: bool):
        async def call(request, context):
            try:
                with self._admitted(method, gate):
                    return await fn(request, context)
            except Exception as e:
                await self._abort(context, method, e)

        return call

    def _client_stream(self, fn, method: str, gate: bool):
        """The servicer gets a `ClientStream`; a refusal waits for the client (bitdelta.rpc.client_stream)."""

        async def call(requests, context):
            stream = ClientStream(requests, context)
            try:
                with self._admitted(method, gate):
                    return await fn(stream, context)
            except Exception as e:
                if not isinstance(e, grpc.aio.AbortError):  # a status already sent cannot wait
                    await stream.refuse()
                await self._abort(context, method, e)

        return call

    def _stream(self, fn, method: str, gate: bool):
        async def call(request, context):
            try:
                with self._admitted(method, gate):
                    async for response in fn(request, context):
                        yield response
            except Exception as e:
                await self._abort(context, method, e)

        return call

    @contextlib.contextmanager
    def _admitted(self, method: str, gate: bool):
        """Counts the call in flight; while draining, refuses it (`gate`) with UNAVAILABLE."""
        if gate and self.calls.draining:
            raise Draining(f"{method.split('/')[1]} is draining (shutting down); send the request to another replica")
        self.calls.enter()
        try:
            yield
        finally:
            self.calls.leave()

    async def _abort(self, context, method: str, e: Exception) -> None:
        if isinstance(e, grpc.aio.AbortError):
            raise e
        code = status_of(e, self.table)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method, exc_info=e)
            message = f"internal error: {type(e).__name__}: {e}"
        else:
            log.info("%s: %s: %s", method, code.name, clip_message(str(e)))
            message = str(e) or type(e).__name__
        public = without_addresses if self.public else str
        trailers = (
            tuple((k, metadata_value(public(v))) for k, v in e.trailers.items()) if isinstance(e, ServiceError) else ()
        )
        await context.abort(code, clip_message(public(message)), trailing_metadata=trailers)


class Server:
    """A started-or-not gRPC server with health, reflection, the error interceptor and drain."""

    def __init__(
        self,
        grpc_server: grpc.aio.Server,
        port: int,
        services: Sequence[str],
        health_servicer: health.aio.HealthServicer,
        calls: _Calls,
        serving_at_start: bool = True,
    ):
        self.grpc, self.port, self.services = grpc_server, port, tuple(services)
        self._health, self._calls = health_servicer, calls
        self._serving_at_start = serving_at_start
        self.health_only: grpc.aio.Server | None = None  # plain-text grpc.health.v1 only (`health_address`)
        self.health_port = 0

    @property
    def in_flight(self) -> int:
        return self._calls.n

    @property
    def draining(self) -> bool:
        return self._calls.draining

    async def start(self, serving: bool | None = None) -> None:
        """Listen; health `serving` (None: the server's `serving` of `create_server`)."""
        await self.grpc.start()
        if self.health_only is not None:
            await self.health_only.start()
        await self.set_serving(self._serving_at_start if serving is None else serving)

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving and not self._calls.draining else NOT_SERVING
        for name in ("", *self.services):
            await self._health.set(name, status)

    async def drain(self, grace_s: float) -> bool:
        """NOT_SERVING, refuse new calls, let calls in flight finish for up to `grace_s`, stop.
        Returns whether everything finished in time."""
        self._calls.draining = True
        await self.set_serving(False)
        t = time.monotonic()
        done = await self._calls.wait_idle(grace_s)
        if not done:
            log.warning("%d calls still running after the %.1f s grace period; cancelling them", self._calls.n, grace_s)
        await self.grpc.stop(max(0.0, min(1.0, grace_s - (time.monotonic() - t))))
        if self.health_only is not None:
            await self.health_only.stop(0)
        return done

    async def stop(self, grace: float | None = None) -> None:
        """Stop at once (tests); `drain` is the graceful way."""
        self._calls.draining = True
        await self._health.enter_graceful_shutdown()
        await self.grpc.stop(grace)
        if self.health_only is not None:
            await self.health_only.stop(0)

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()


# gRPC sets SO_REUSEPORT on Linux by default: a second server on a port already served binds too
# and the kernel splits the connections between the two (a worker started on the router's port would
# answer half its calls with UNIMPLEMENTED). Off: the second server cannot listen and says so.
_EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


def create_server(
    address: str,
    services: Sequence[Service],
    status_table: StatusTable = NO_TABLE,
    *,
    serving: bool = True,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    open_while_draining: Iterable[str] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    health_address: str = "",
    public: bool = False,
) -> Server:
    """A server for `services` bound to `address` (HOST:PORT; port 0 picks a free one), not started.

    `serving=False` keeps health NOT_SERVING after `start()` until `set_serving(True)` (a worker
    loading its base). Raises OSError naming the address when it cannot bind. Call in a running loop.
    `credentials` (`bitdelta.rpc.security.TlsSettings.server_credentials`): TLS, else plain text.
    `health_address`: also serve `grpc.health.v1` alone, in plain text, there (Kubernetes' grpc
    probes cannot present a client certificate); `server.health_port` says which port.
    `interceptors` run inside the error interceptor: they refuse a call by raising a
    `ServiceError` (`security.AuthInterceptor`). `status_table`: codes of exceptions outside the
    `ServiceError` family (the core library's, which knows no gRPC). `public`: status messages
    and trailers name no network address (a service whose callers are outside the deployment).
    """
    calls = _Calls()
    names = [s.name for s in services]
    server = grpc.aio.server(
        interceptors=[
            TraceInterceptor(names),  # traces outside: they see the final status
            _ErrorInterceptor(names, status_table, calls, set(open_while_draining), public),
            *interceptors,
        ],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *_EXCLUSIVE_PORT,
        ],
    )
    for s in services:
        s.register(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    out = Server(server, port, names, hs, calls, serving_at_start=serving)
    if health_address:
        out.health_only = grpc.aio.server(options=_EXCLUSIVE_PORT)
        health_pb2_grpc.add_HealthServicer_to_server(hs, out.health_only)  # the same statuses, nothing else
        try:
            out.health_port = out.health_only.add_insecure_port(health_address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {health_address}: {e}") from None
    return out


async def run_until_signal(
    server: Server,
    grace_s: float,
    *,
    startup: Awaitable[None] | None = None,
    on_drain: Callable[[], None] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The process lifecycle: start, run `startup` (health NOT_SERVING until it has finished, then
    SERVING), serve until SIGTERM/SIGINT, then `on_drain()`, drain (`Server.drain`), `on_stop()`.

    A `startup` that fails stops the server and raises SystemExit(1) (the error is logged): it never
    said SERVING, so whoever waits for it sees the process exit instead.
    """
    await server.start(serving=False if startup is not None else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    try:
        if startup is not None:
            starter = asyncio.ensure_future(startup)
            await asyncio.wait({starter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if starter.done() and starter.exception() is not None:
                log.error("could not start: %s", starter.exception())
                await server.stop(0)
                raise SystemExit(1)
            if not starter.done():
                starter.cancel()
            else:
                await server.set_serving(True)
        await stopper
        log.info("draining: health NOT_SERVING, calls in flight get %.1f s", grace_s)
        if on_drain is not None:
            on_drain()
        await server.drain(grace_s)
    finally:
        stopper.cancel()
        if on_stop is not None:
            await on_stop()
    log.info("stopped")
