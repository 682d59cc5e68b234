"""The delta store's gRPC surface on the shared server skeleton (`bitdelta.rpc.serve`).

The servicer only translates protobuf <-> the core (`store.DeltaStore`); the
skeleton's one interceptor answers the core's exceptions with the status code
each carries (`errors`) and gives health, reflection and the SIGTERM drain.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from opentelemetry import trace

from bitdelta.cache_policy import WeightedLRUPolicy
from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from bitdelta.rpc import telemetry
from bitdelta.rpc.client_stream import ClientStream
from bitdelta.rpc.metrics import StoreMetrics
from bitdelta.rpc.security import AuthInterceptor, Role
from bitdelta.rpc.serve import Server, Service, run_until_signal
from bitdelta.rpc.serve import create_server as create_rpc_server
from bitdelta.rpc.wire.delta_store import MAX_MESSAGE_BYTES, SHARED_LEASE_S
from services.delta_store.backends import Backend
from services.delta_store.cache import HostCache
from services.delta_store.config import Config
from services.delta_store.errors import BackendUnavailable, InvalidUpload
from services.delta_store.shm import SharedMemoryDir
from services.delta_store.store import DeltaStore, Shard, TensorSlice

log = logging.getLogger("services.delta_store")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DeltaStoreService"].full_name

# With --tokens-file: Put and Delete need an admin token; List, Stat and Fetch need none (with mutual
# TLS on, only holders of a certificate of the CA reach them).
ADMIN_METHODS = {"Put": Role.ADMIN, "Delete": Role.ADMIN}


def shard_of(p: pb.Shard) -> Shard:
    """FetchRequest.shard as the core's Shard."""
    return Shard(
        p.rank,
        p.size,
        {
            s.tensor: TensorSlice(
                tuple((r.start, r.end) for r in s.rows) or None,
                (s.cols.start, s.cols.end) if s.HasField("cols") else None,
                s.omit,
            )
            for s in p.slices
        },
    )


class DeltaStoreServicer(pb_grpc.DeltaStoreServiceServicer):
    def __init__(self, store: DeltaStore, metrics: StoreMetrics | None = None):
        self.store, self.metrics = store, metrics

    async def List(self, request, context):
        return pb.ListResponse(deltas=[d.info_proto() for d in await self.store.list()])

    async def Stat(self, request, context):
        d = await self.store.stat(request.name)
        return pb.StatResponse(info=d.info_proto(), tensors=d.tensors_proto(), header_bytes=d.header.header_bytes)

    async def Fetch(self, request, context):
        stream = await self.store.fetch(
            request.name,
            request.chunk_bytes,
            request.expect_base_fingerprint,
            request.accept_shared_memory,
            shard_of(request.shard) if request.HasField("shard") else None,
        )
        if self.metrics is not None:
            self.metrics.fetches.labels(request.name).inc()
        async with stream:
            shared = (
                pb.SharedMemory(path=stream.shared_path, size_bytes=stream.delta.size) if stream.shared_path else None
            )
            yield pb.FetchResponse(
                info=stream.delta.info_proto(),
                tensors=stream.tensors_proto(),
                shared_memory=shared,
                verified=stream.verified,
            )
            async for c in stream:
                # counted before the yield: a receiver that has its last chunk may end the call (a
                # shared-memory lease does), cancelling this generator at the yield
                if self.metrics is not None:
                    self.metrics.bytes_served.inc(c.nbytes)
                yield pb.FetchResponse(
                    chunk=pb.Chunk(
                        tensor_index=c.tensor_index,
                        offset=c.offset,
                        data=c.data,
                        crc32=c.crc32,
                        length=c.length,
                        **({} if c.file_offset is None else {"file_offset": c.file_offset}),
                    )
                )
            if stream.shared_path:
                # The lease: the receiver copies out of the file after the last descriptor and ends the
                # call when done (this task is cancelled then); until then the entry counts as read.
                await asyncio.sleep(SHARED_LEASE_S)

    async def Put(self, requests: ClientStream, context):
        """The store answers the header (`accept`) before the client sends data; a refusal is the
        skeleton's (`bitdelta.rpc.client_stream`)."""
        first = await requests.first()
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidUpload("the first Put message must carry the header (name, size_bytes)")
        h = first.header
        requests.announced(h.size_bytes)

        async def data():
            async for m in requests:
                if m.WhichOneof("part") != "data":
                    raise InvalidUpload("only the first Put message may carry a header; the rest carry data")
                yield m.data

        d = await self.store.put(h.name, h.size_bytes, h.overwrite, data(), accepted=requests.accept)
        return pb.PutResponse(info=d.info_proto())

    async def Delete(self, request, context):
        await self.store.delete(request.name)
        return pb.DeleteResponse()


def make_backend(config: Config) -> Backend:
    """The backend that `config` selects (each imported only when chosen: the S3 client's modules
    load only for S3)."""
    if config.backend == "local":
        from services.delta_store.backends.local import LocalBackend

        return LocalBackend(config.root)
    from services.delta_store.backends.s3 import S3Backend

    return S3Backend(
        bucket=config.s3_bucket,
        prefix=config.s3_prefix,
        endpoint=config.s3_endpoint,
        region=config.s3_region,
        timeout_s=config.backend_timeout_s,
    )


def create_server(
    config: Config,
    *,
    backend: Backend | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    metrics: bool = False,
) -> tuple[Server, DeltaStore]:
    """The server bound to `config.address` (port 0: any free port; `server.port` says which) and its
    store; not started. Call in a running loop."""
    backend = backend or make_backend(config)
    policy = WeightedLRUPolicy(config.cache_bytes, half_life_s=config.rate_half_life_s, pin_top_n=config.pin_top_n)
    shared = SharedMemoryDir(config.shared_memory_dir) if config.shared_memory_dir else None
    store = DeltaStore(
        backend,
        HostCache(policy, shared=shared),
        chunk_bytes=config.chunk_bytes,
        read_block_bytes=config.read_block_bytes,
        verify_reads=config.verify_reads,
        tracer_provider=tracer_provider,
    )
    servicer = DeltaStoreServicer(
        store,
        StoreMetrics(lambda: dict(store.cache.stats), lambda: store.cache.used_bytes, lambda: dict(store.transports))
        if metrics
        else None,
    )
    store.metrics = servicer.metrics  # StoreMetrics, or None
    service = Service(SERVICE_NAME, lambda s: pb_grpc.add_DeltaStoreServiceServicer_to_server(servicer, s))
    server = create_rpc_server(
        config.address,
        [service],
        max_message_bytes=MAX_MESSAGE_BYTES,
        open_while_draining=("List", "Stat"),
        credentials=config.server_credentials(),
        interceptors=[AuthInterceptor([SERVICE_NAME], config.tokens(), ADMIN_METHODS)],
        health_address=config.health_address,
    )
    return server, store


async def serve(config: Config) -> None:
    telemetry.setup("delta_store", config.otlp_endpoint, instance=config.address)
    server, store = create_server(config, metrics=True)
    metrics = store.metrics
    if config.metrics_address:
        metrics.serve(config.metrics_address)
    where = (
        config.root
        if config.backend == "local"
        else f"{config.s3_endpoint or 'aws'}/{config.s3_bucket}/{config.s3_prefix}"
    )
    log.info(
        "delta store listening on port %d (%s), backend %s %s, cache %d bytes",
        server.port,
        config.address,
        config.backend,
        where,
        config.cache_bytes,
    )
    if store.cache.shared is not None:
        log.info("host cache in shared memory under %s: same-host workers map it", store.cache.shared.dir)

    async def startup() -> None:
        try:
            log.info("%d deltas in the store", len(await store.list()))
        except BackendUnavailable as e:
            log.warning("the backend is unavailable at start-up (calls fail with UNAVAILABLE until it is back): %s", e)

    try:
        await run_until_signal(server, config.grace_s, startup=startup(), on_stop=store.close)
    finally:
        metrics.close()
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    config = Config.main_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except OSError as e:
        print(f"delta_store: {e}", file=sys.stderr)
        raise SystemExit(2) from None
