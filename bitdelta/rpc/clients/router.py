"""The async client of the router: the public API, for the CLI, the gateway and tests.

    async with RouterClient("127.0.0.1:50051") as r:
        async for msg in r.generate("coder", "def fib(n):", max_new_tokens=40):
            print(msg.text, end="")
        models = await r.list_models()

Failures raise `RouterCallError` (an `RpcError`) with the router's status code.
"""

from __future__ import annotations

from typing import AsyncIterator, Sequence

import grpc

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.router.v1 import router_pb2_grpc as pb_grpc
from bitdelta.rpc.errors import RpcError, from_aio_error
from bitdelta.rpc.telemetry import client_interceptors

MAX_MESSAGE_BYTES = 64 << 20


class RouterCallError(RpcError):
    """A router call failed; `code` is its status."""


class RouterClient:
    """One channel to a router; share it."""

    def __init__(self, target: str, *, timeout_s: float = 10.0, generate_timeout_s: float = 600.0):
        self.target, self.timeout_s, self.generate_timeout_s = target, timeout_s, generate_timeout_s
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ], interceptors=client_interceptors())  # fmt: skip  (trace context to the callee)
        self._stub = pb_grpc.RouterServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "RouterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _error(self, e: grpc.aio.AioRpcError, what: str) -> RouterCallError:
        err = from_aio_error(e, f"router {self.target}", what)
        return RouterCallError(str(err), err.code, service=err.service, details=err.details, trailers=err.trailers)

    async def generate_request(self, request: pb.GenerateRequest, timeout_s: float | None = None,
                               metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[pb.GenerateResponse]:
        """The router's stream for `request`; leaving the loop early cancels the call downstream."""
        call = self._stub.Generate(request, timeout=timeout_s or self.generate_timeout_s,
                                   metadata=tuple(metadata) or None)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"Generate({request.model_id[:80]!r})") from None
        finally:
            call.cancel()

    def generate(self, model_id: str, prompt: str, *, max_new_tokens: int = 0, temperature: float = 0.0,
                 top_p: float = 0.0, stop: Sequence[str] = (), seed: int = 0, request_id: str = "",
                 timeout_s: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        sampling = gen_pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                         stop=list(stop), seed=seed)  # fmt: skip
        req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=sampling, request_id=request_id)
        return self.generate_request(req, timeout_s)

    async def list_models(self, timeout_s: float | None = None) -> list[pb.ModelInfo]:
        try:
            r = await self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "ListModels") from None
        return list(r.models)

    async def list_workers(self, timeout_s: float | None = None) -> list[pb.WorkerInfo]:
        try:
            r = await self._stub.ListWorkers(pb.ListWorkersRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "ListWorkers") from None
        return list(r.workers)
