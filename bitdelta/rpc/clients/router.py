"""The async client of the router: the public API, for the CLI, the gateway and tests.

    async with RouterClient("127.0.0.1:50051") as r:
        async for msg in r.generate("coder", "def fib(n):", max_new_tokens=40):
            print("".join(t.text for t in msg.tokens), end="")   # every token the router had ready
        models = await r.list_models()

Failures raise `RouterCallError` (an `RpcError`) with the router's status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from bitdelta.generation import Sampling
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.router.v1 import router_pb2_grpc as pb_grpc
from bitdelta.rpc.clients.base import Client
from bitdelta.rpc.errors import RpcError


class RouterCallError(RpcError):
    """A router call failed; `code` is its status."""


class RouterClient(Client):
    """One channel to a router; share it."""

    SERVICE = "router"
    ERROR = RouterCallError

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
        self._stub = pb_grpc.RouterServiceStub(self.channel)

    def generate_request(
        self, request: pb.GenerateRequest, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The router's stream for `request`: each message holds every token the router had ready when
        it wrote it (`msg.tokens`; the request's fields on the first); leaving the loop early cancels
        the call downstream."""
        return self._stream(
            self._stub.Generate,
            request,
            f"Generate({request.model_id[:80]!r})",
            timeout_s or self.generate_timeout_s,
            metadata,
        )

    def generate(
        self,
        model_id: str,
        prompt: str,
        *,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        request_id: str = "",
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Generate with these sampling fields (`bitdelta.generation.Sampling`'s, unchecked: the router checks)."""
        sampling = Sampling(max_new_tokens, temperature, top_p, tuple(stop), seed)
        req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=sampling.to_pb(), request_id=request_id)
        return self.generate_request(req, timeout_s, metadata)

    async def list_models(
        self, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> list[pb.ModelInfo]:
        r = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), "ListModels", timeout_s, metadata)
        return list(r.models)

    async def list_workers(
        self, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> list[pb.WorkerInfo]:
        r = await self._unary(self._stub.ListWorkers, pb.ListWorkersRequest(), "ListWorkers", timeout_s, metadata)
        return list(r.workers)
