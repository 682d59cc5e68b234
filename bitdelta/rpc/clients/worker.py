"""The async client of a GPU worker, for the router and tools.

    async with WorkerClient("127.0.0.1:50061") as w:
        async for msg in w.generate(gpu_worker_pb2.GenerateRequest(model_id="coder", prompt="def f("),
                                    timeout_s=30):
            ...
        st = await w.status()

Every call has a deadline. Failures raise `WorkerCallError` (an `RpcError`) with
the worker's status code; leaving a `generate` iteration early cancels the
call, so the worker frees the sequence.
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.rpc.errors import RpcError, from_aio_error
from bitdelta.rpc.telemetry import client_interceptors

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GpuWorkerService"].full_name
MAX_MESSAGE_BYTES = 64 << 20


class WorkerCallError(RpcError):
    """A worker call failed; `code` is the worker's status."""


class WorkerClient:
    """One channel to one worker; share it. Use `async with` or call `close()`."""

    def __init__(self, target: str, *, timeout_s: float = 10.0, generate_timeout_s: float = 600.0):
        self.target, self.timeout_s, self.generate_timeout_s = target, timeout_s, generate_timeout_s
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ], interceptors=client_interceptors())  # fmt: skip  (trace context to the callee)
        self._stub = pb_grpc.GpuWorkerServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "WorkerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _error(self, e: grpc.aio.AioRpcError, what: str) -> WorkerCallError:
        err = from_aio_error(e, f"worker {self.target}", what)
        return WorkerCallError(str(err), err.code, service=err.service, details=err.details, trailers=err.trailers)

    async def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[pb.GenerateResponse]:
        """The worker's stream for `request`; breaking out of the loop (or being cancelled) cancels the call."""
        call = self._stub.Generate(request, timeout=timeout_s or self.generate_timeout_s, metadata=metadata or None)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"Generate({request.model_id!r})") from None
        finally:
            call.cancel()

    async def load_delta(self, name: str, pin: bool = False, timeout_s: float | None = None) -> pb.LoadDeltaResponse:
        try:
            return await self._stub.LoadDelta(pb.LoadDeltaRequest(name=name, pin=pin),
                                              timeout=timeout_s or self.generate_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"LoadDelta({name!r})") from None

    async def evict_delta(self, name: str, timeout_s: float | None = None) -> pb.EvictDeltaResponse:
        try:
            return await self._stub.EvictDelta(pb.EvictDeltaRequest(name=name), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"EvictDelta({name!r})") from None

    async def status(self, timeout_s: float | None = None) -> pb.StatusResponse:
        try:
            return await self._stub.Status(pb.StatusRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "Status") from None

    async def serving(self, timeout_s: float | None = None) -> bool:
        """Whether the worker's health says SERVING (False while loading its base or draining)."""
        try:
            r = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                         timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "Health.Check") from None
        return r.status == health_pb2.HealthCheckResponse.SERVING
