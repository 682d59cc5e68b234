"""The delta store's gRPC server: servicer, error interceptor, health, reflection, lifecycle.

The servicer only translates protobuf <-> the core (`store.DeltaStore`); the
one interceptor maps the core's exceptions to status codes (`STATUS_OF`).
`grpc.health.v1` reports SERVING, and NOT_SERVING while draining; SIGTERM
drains: health goes NOT_SERVING, in-flight calls get `grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from bitdelta.cache_policy import WeightedLRUPolicy
from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from bitdelta.format import BaseMismatchError
from services.delta_store.backends import Backend, make_backend
from services.delta_store.cache import HostCache
from services.delta_store.config import MAX_CHUNK_BYTES, Config, ConfigError
from services.delta_store.errors import (AlreadyExists, BackendUnavailable, CorruptDelta, InvalidName, InvalidUpload,
                                         NotFound)
from services.delta_store.store import DeltaStore

log = logging.getLogger("services.delta_store")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DeltaStoreService"].full_name
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # a chunk plus the first message's header listing
STATUS_OF: dict[type[BaseException], grpc.StatusCode] = {
    InvalidName: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidUpload: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    BaseMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    CorruptDelta: grpc.StatusCode.DATA_LOSS,
    BackendUnavailable: grpc.StatusCode.UNAVAILABLE,
}
TENSOR_METADATA_KEY = "bitdelta-tensor"  # trailing metadata of DATA_LOSS: the bad tensor's name


class DeltaStoreServicer(pb_grpc.DeltaStoreServiceServicer):
    def __init__(self, store: DeltaStore):
        self.store = store

    async def List(self, request, context):
        return pb.ListResponse(deltas=[d.info_proto() for d in await self.store.list()])

    async def Stat(self, request, context):
        d = await self.store.stat(request.name)
        return pb.StatResponse(info=d.info_proto(), tensors=d.tensors_proto(), header_bytes=d.header.header_bytes)

    async def Fetch(self, request, context):
        stream = await self.store.fetch(request.name, request.chunk_bytes, request.expect_base_fingerprint)
        async with stream:
            yield pb.FetchResponse(info=stream.delta.info_proto(), tensors=stream.delta.tensors_proto())
            async for c in stream:
                yield pb.FetchResponse(chunk=pb.Chunk(tensor_index=c.tensor_index, offset=c.offset, data=c.data, crc32=c.crc32))

    async def Put(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidUpload("the first Put message must carry the header (name, size_bytes)")
        h = first.header

        async def data():
            async for m in request_iterator:
                if m.WhichOneof("part") != "data":
                    raise InvalidUpload("only the first Put message may carry a header; the rest carry data")
                yield m.data

        d = await self.store.put(h.name, h.size_bytes, h.overwrite, data())
        return pb.PutResponse(info=d.info_proto())

    async def Delete(self, request, context):
        await self.store.delete(request.name)
        return pb.DeleteResponse()


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps the store's exceptions to status codes with the exception's message; anything else is INTERNAL."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream), **kw)


def _unary(fn):
    async def call(request, context):
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, e)

    return call


def _streaming(fn):
    async def call(request, context):
        try:
            async for response in fn(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, e)

    return call


async def _abort(context, e: Exception):
    code = next((c for t, c in STATUS_OF.items() if isinstance(e, t)), None)
    if code is None:
        log.exception("internal error")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the delta store: {type(e).__name__}: {e}")
    tensor = getattr(e, "tensor", None)
    await context.abort(code, str(e), trailing_metadata=((TENSOR_METADATA_KEY, tensor),) if tensor else ())


class DeltaStoreServer:
    """The gRPC server with its store and health; `stop` drains."""

    def __init__(self, server: grpc.aio.Server, store: DeltaStore, health_servicer):
        self.grpc, self.store, self.health = server, store, health_servicer

    async def start(self) -> None:
        await self.grpc.start()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()  # every service reports NOT_SERVING
        await self.grpc.stop(grace)
        await self.store.close()

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()


def create_server(config: Config, *, backend: Backend | None = None,
                  tracer_provider: trace.TracerProvider | None = None) -> tuple[DeltaStoreServer, int]:
    """Build the server bound to `config.address` (port 0: any free port); returns it and its port. Call in a running loop."""
    backend = backend or make_backend(config)
    policy = WeightedLRUPolicy(config.cache_bytes, half_life_s=config.rate_half_life_s, pin_top_n=config.pin_top_n)
    store = DeltaStore(backend, HostCache(policy), chunk_bytes=config.chunk_bytes, read_block_bytes=config.read_block_bytes,
                       verify_reads=config.verify_reads, tracer_provider=tracer_provider)
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor()],
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    pb_grpc.add_DeltaStoreServiceServicer_to_server(DeltaStoreServicer(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(config.address)
    except RuntimeError as e:
        raise ConfigError(f"cannot listen on --address {config.address}: {e}") from None
    return DeltaStoreServer(server, store, health_servicer), port


async def serve(config: Config) -> None:
    server, port = create_server(config)
    await server.start()
    where = config.root if config.backend == "local" else f"{config.s3_endpoint or 'aws'}/{config.s3_bucket}/{config.s3_prefix}"
    log.info("delta store listening on port %d (%s), backend %s %s, cache %d bytes", port, config.address,
             config.backend, where, config.cache_bytes)
    try:
        n = len(await server.store.list())
        log.info("%d deltas in the store", n)
    except BackendUnavailable as e:
        log.warning("the backend is unavailable at start-up (calls fail with UNAVAILABLE until it is back): %s", e)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining: health NOT_SERVING, in-flight calls get %.1fs", config.grace_s)
    await server.stop(config.grace_s)
    log.info("stopped")


def main(argv: list[str] | None = None) -> None:
    try:
        config = Config.from_args(argv)
    except ConfigError as e:
        print(f"delta_store: bad configuration: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except ConfigError as e:
        print(f"delta_store: bad configuration: {e}", file=sys.stderr)
        raise SystemExit(2) from None
