"""gRPC surface of the worker on the shared server skeleton (`bitdelta.rpc.serve`): the servicer
(protobuf <-> domain only) and the process lifecycle. The skeleton maps exceptions to status codes
(`errors.status_of`), serves health and reflection, and drains on SIGTERM.

    worker = Worker(config)
    server = create_server(worker, "127.0.0.1:0")       # port 0 in tests; server.port says which
    await server.start(); await worker.start(); await server.set_serving(True)  # SERVING once loaded

`serve(config)` is the process (`python -m services.gpu_worker`); tests run the pieces
themselves (tests/support/worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from bitdelta.generation import Request
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.rpc import telemetry
from bitdelta.rpc.errors import status_of
from bitdelta.rpc.metrics import WorkerMetrics
from bitdelta.rpc.security import AuthInterceptor, Role
from bitdelta.rpc.serve import Server, Service, run_until_signal
from bitdelta.rpc.serve import create_server as create_rpc_server
from bitdelta.rpc.wire.gpu_worker import events_to_pb
from services.gpu_worker.errors import STATUS_OF
from services.gpu_worker.manager import DeltaState, SlotInfo
from services.gpu_worker.worker import Worker

log = logging.getLogger("gpu_worker.server")
SERVICE = pb.DESCRIPTOR.services_by_name["GpuWorkerService"].full_name
MAX_MESSAGE_BYTES = 64 << 20

STATES = {
    DeltaState.ABSENT: pb.DELTA_STATE_ABSENT,
    DeltaState.LOADING: pb.DELTA_STATE_LOADING,
    DeltaState.RESIDENT: pb.DELTA_STATE_RESIDENT,
    DeltaState.EVICTING: pb.DELTA_STATE_EVICTING,
    DeltaState.FAILED: pb.DELTA_STATE_FAILED,
}


def slot_to_pb(s: SlotInfo) -> pb.DeltaSlot:
    return pb.DeltaSlot(
        name=s.name,
        state=STATES[s.state],
        bytes=s.bytes,
        pinned=s.pinned,
        request_rate=s.request_rate,
        error=s.error,
        transport=s.transport,
        slots=s.slots,
    )


# With --tokens-file: loading and evicting deltas need an admin token; Generate and Status (the
# router's calls) need none (with mutual TLS on, only holders of a certificate of the CA reach them).
ADMIN_METHODS = {"LoadDelta": Role.ADMIN, "EvictDelta": Role.ADMIN}


class GpuWorkerServicer(pb_grpc.GpuWorkerServiceServicer):
    def __init__(self, worker: Worker, metrics: WorkerMetrics | None = None):
        self.worker, self.metrics = worker, metrics

    async def Generate(self, request, context):
        remaining = context.time_remaining()
        req = Request.from_pb(request, None if remaining is None else time.monotonic() + remaining)
        m, model, status, last_ms = self.metrics, request.model_id or "base", "OK", None
        try:
            async for ready in self.worker.stream(req):  # every token ready when the last write finished
                if m is not None:
                    for ev in ready:
                        if ev.ttft is not None:
                            m.ttft.labels(model, ev.arrival.value).observe(ev.ttft.total_ms / 1e3)
                        elif last_ms is not None:
                            m.itl.labels(model).observe((ev.elapsed_ms - last_ms) / 1e3)
                        last_ms = ev.elapsed_ms
                    m.tokens.labels(model).inc(len(ready))
                yield events_to_pb(ready)
        except BaseException as e:
            status = (
                "CANCELLED" if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else status_of(e, STATUS_OF).name
            )
            raise
        finally:
            if m is not None:
                m.requests.labels(model, status).inc()

    async def LoadDelta(self, request, context):
        info, waited = await self.worker.load_delta(request.name, pin=request.pin)
        return pb.LoadDeltaResponse(slot=slot_to_pb(info), load_ms=waited)

    async def EvictDelta(self, request, context):
        state = await self.worker.evict_delta(request.name)
        return pb.EvictDeltaResponse(state=STATES[state])

    async def Status(self, request, context):
        s = self.worker.status()
        return pb.StatusResponse(
            base_model=s.base_model,
            base_fingerprint=s.base_fingerprint,
            device=s.device,
            slots=[slot_to_pb(x) for x in s.slots],
            delta_budget_bytes=s.delta_budget_bytes,
            delta_used_bytes=s.delta_used_bytes,
            running=s.running,
            waiting=s.waiting,
            kv_tokens_used=s.kv_tokens_used,
            kv_tokens_total=s.kv_tokens_total,
            draining=self.worker.draining,
            ready=self.worker.ready,
            loads_started=self.worker.manager.loads_started if self.worker.manager is not None else 0,
            preemptions=s.preemptions,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            tensor_parallel=s.tensor_parallel,
            ranks=[
                pb.RankMemory(
                    rank=r.rank,
                    device=r.device,
                    base_bytes=r.base_bytes,
                    slot_stack_bytes=r.slot_stack_bytes,
                    kv_bytes=r.kv_bytes,
                    delta_bytes=r.delta_bytes,
                )
                for r in s.ranks
            ],
        )


def create_server(worker: Worker, address: str, metrics: WorkerMetrics | None = None) -> Server:
    """A server for `worker` bound to `address` (port 0 picks a free port); not started.

    Health reports NOT_SERVING until the base is loaded and `server.set_serving(True)`.
    """
    servicer = GpuWorkerServicer(worker, metrics)
    service = Service(SERVICE, lambda s: pb_grpc.add_GpuWorkerServiceServicer_to_server(servicer, s))
    c = worker.config
    return create_rpc_server(
        address,
        [service],
        STATUS_OF,
        serving=False,
        max_message_bytes=MAX_MESSAGE_BYTES,
        open_while_draining=("Status", "EvictDelta"),
        credentials=c.server_credentials(),
        interceptors=[AuthInterceptor([SERVICE], c.tokens(), ADMIN_METHODS)],
        health_address=c.health_address,
    )


async def serve(config) -> None:
    """The process: bind, load the base, serve until SIGTERM/SIGINT, drain."""
    telemetry.setup("worker", config.otlp_endpoint, instance=config.address)
    worker = Worker(config)
    worker.on_fatal = lambda: os.kill(os.getpid(), signal.SIGTERM)  # drain and stop, as on SIGTERM
    metrics = worker_metrics(worker)
    if config.metrics_address:
        metrics.serve(config.metrics_address)
    server = create_server(worker, config.address, metrics)
    log.info("gpu_worker listening on %s (port %d); loading base %s", config.address, server.port, config.base)
    try:
        await run_until_signal(
            server,
            config.grace_s,
            startup=_start_with_metrics(worker, metrics),
            on_drain=worker.begin_drain,
            on_stop=worker.close,
        )
    finally:
        metrics.close()
        telemetry.shutdown()
    if worker.fatal:
        log.error("stopped: %s", worker.fatal)
        raise SystemExit(1)


def worker_metrics(worker: Worker) -> WorkerMetrics:
    """The worker's metrics; levels are read from the worker at scrape time."""

    def state() -> dict:
        mgr = worker.manager
        if mgr is None or not worker.ready:
            return dict.fromkeys(
                (
                    "resident_deltas",
                    "delta_used_bytes",
                    "loads",
                    "evictions",
                    "kv_blocks_used",
                    "kv_blocks_total",
                    "running",
                    "waiting",
                    "prefill_tokens",
                    "preemptions",
                    "prefix_cache_queries",
                    "prefix_cache_hits",
                    "tp_collectives",
                ),
                0,
            ) | {"delta_budget_bytes": worker.config.delta_budget, "tensor_parallel": worker.config.tensor_parallel}
        alloc = worker.scheduler.allocator
        return {
            "resident_deltas": sum(e.state == DeltaState.RESIDENT for e in mgr.entries.values()),
            "delta_used_bytes": mgr.used_bytes,
            "delta_budget_bytes": mgr.budget_bytes,
            "loads": mgr.loads_started,
            "evictions": mgr.evictions,
            "kv_blocks_used": alloc.n_blocks - alloc.n_free,
            "kv_blocks_total": alloc.n_blocks,
            "running": worker.engine.running,
            "waiting": worker.engine.waiting,
            "prefill_tokens": worker.engine.prefill_tokens,
            "preemptions": worker.scheduler.preemptions,
            "prefix_cache_queries": worker.scheduler.prefix_queries,
            "prefix_cache_hits": worker.scheduler.prefix_hits,
            "tensor_parallel": worker.config.tensor_parallel,
            "tp_collectives": worker.tp.collectives if worker.tp is not None else 0,
        }

    return WorkerMetrics(state)


async def _start_with_metrics(worker: Worker, metrics: WorkerMetrics) -> None:
    await worker.start()
    worker.manager.on_loaded = lambda name, nbytes, seconds: metrics.load_seconds.observe(seconds)
