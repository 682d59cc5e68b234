"""The async client of a GPU worker, for the router and tools.

    async with WorkerClient("127.0.0.1:50061") as w:
        async for ev in w.generate(gpu_worker_pb2.GenerateRequest(model_id="coder", prompt="def f("),
                                   timeout_s=30):
            ...   # bitdelta.generation.TokenEvent; w.stream(...): one list per message
        st = await w.status()

Every call has a deadline. Failures raise `WorkerCallError` (an `RpcError`) with
the worker's status code; leaving a `generate` iteration early cancels the
call, so the worker frees the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.generation import TokenEvent
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.rpc.clients.base import Client
from bitdelta.rpc.errors import RpcError
from bitdelta.rpc.wire.gpu_worker import events_of_pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GpuWorkerService"].full_name


class WorkerCallError(RpcError):
    """A worker call failed; `code` is the worker's status."""


class WorkerClient(Client):
    """One channel to one worker; share it."""

    SERVICE = "worker"
    ERROR = WorkerCallError

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 10.0,
        generate_timeout_s: float = 600.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
    ):
        super().__init__(target, timeout_s=timeout_s, credentials=credentials, token=token)  # TLS, bearer
        self.generate_timeout_s = generate_timeout_s
        self._stub = pb_grpc.GpuWorkerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def stream(
        self, request: pb.GenerateRequest, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[list[TokenEvent]]:
        """The worker's stream for `request`, one list of domain events per message (every token
        the worker had ready when it wrote it); breaking out of the loop (or being cancelled)
        cancels the call."""
        what = f"Generate({request.model_id[:80]!r})"
        stream = self._stream(self._stub.Generate, request, what, timeout_s or self.generate_timeout_s, metadata)
        try:
            async for msg in stream:
                if msg is None or not msg.tokens:  # None: bytes grpc's aio stub cannot decode (a broken worker)
                    raise self.ERROR(
                        f"{self.SERVICE} {self.target} {what}: sent a message that is not a GenerateResponse "
                        "with tokens",
                        grpc.StatusCode.UNAVAILABLE,
                        service=f"{self.SERVICE} {self.target}",
                    )
                yield events_of_pb(msg)
        finally:
            await stream.aclose()

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[TokenEvent]:
        """`stream`'s events one at a time; leaving the loop cancels the call."""
        async with contextlib.aclosing(self.stream(request, timeout_s, metadata)) as messages:
            async for events in messages:
                for ev in events:
                    yield ev

    async def load_delta(self, name: str, pin: bool = False, timeout_s: float | None = None) -> pb.LoadDeltaResponse:
        return await self._unary(
            self._stub.LoadDelta,
            pb.LoadDeltaRequest(name=name, pin=pin),
            f"LoadDelta({name[:80]!r})",
            timeout_s or self.generate_timeout_s,
        )

    async def evict_delta(self, name: str, timeout_s: float | None = None) -> pb.EvictDeltaResponse:
        return await self._unary(
            self._stub.EvictDelta, pb.EvictDeltaRequest(name=name), f"EvictDelta({name[:80]!r})", timeout_s
        )

    async def status(self, timeout_s: float | None = None) -> pb.StatusResponse:
        return await self._unary(self._stub.Status, pb.StatusRequest(), "Status", timeout_s)

    async def serving(self, timeout_s: float | None = None) -> bool:
        """Whether the worker's health says SERVING (False while loading its base or draining)."""
        r = await self._unary(
            self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME), "Health.Check", timeout_s
        )
        return r.status == health_pb2.HealthCheckResponse.SERVING
