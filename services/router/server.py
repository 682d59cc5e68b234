"""The router's gRPC surface on the shared server skeleton: the servicer (protobuf <-> domain
only) and the process. Errors keep their status codes: the router's own (`errors`) and the
workers' and store's (`RpcError`, passed through).

    router = Router(config, pool, registry)
    server = create_server(router, "127.0.0.1:0")       # server.port
    await server.start(); await router.start()
"""

from __future__ import annotations

import asyncio
import logging
import time

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.router.v1 import router_pb2_grpc as pb_grpc
from bitdelta.rpc import telemetry
from bitdelta.rpc.clients.delta_store import DeltaStoreClient
from bitdelta.rpc.errors import status_of
from bitdelta.rpc.metrics import RouterMetrics
from bitdelta.rpc.security import AuthInterceptor, Role, current_principal
from bitdelta.rpc.serve import Server, Service, run_until_signal
from bitdelta.rpc.serve import create_server as create_rpc_server
from services.router.config import RouterConfig
from services.router.pool import WorkerPool
from services.router.registry import Registry
from services.router.router import Arrival, GenerateParams, Router

log = logging.getLogger("services.router.server")
SERVICE = pb.DESCRIPTOR.services_by_name["RouterService"].full_name
MAX_MESSAGE_BYTES = 64 << 20
TTFT_FIELDS = ("queue_ms", "delta_load_ms", "schedule_ms", "prefill_ms", "total_ms")
# With --tokens-file: every method needs a known token; ListWorkers (the workers' addresses and load) an admin one.
ROLES = {"ListWorkers": Role.ADMIN}
ARRIVAL = {
    Arrival.BASE: pb.ARRIVAL_STATE_UNSPECIFIED,
    Arrival.RESIDENT: pb.ARRIVAL_STATE_RESIDENT,
    Arrival.LOADING: pb.ARRIVAL_STATE_LOADING,
    Arrival.COLD: pb.ARRIVAL_STATE_COLD,
}
ARRIVAL_NAME = {v: ("base" if k == Arrival.BASE else k.value) for k, v in ARRIVAL.items()}


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, router: Router, metrics: RouterMetrics | None = None):
        self.router, self.metrics = router, metrics

    async def Generate(self, request, context):
        status, last_ms, arrival = "OK", None, ""  # instrumentation: metrics and the span's attributes
        span = telemetry.trace.get_current_span()
        span.set_attribute("model_id", request.model_id)
        try:
            async for out in self._generate(request, context):
                if out.HasField("ttft"):
                    arrival = ARRIVAL_NAME[out.arrival_state]
                    span.set_attributes(
                        {
                            "worker": out.worker,
                            "arrival_state": arrival,
                            **{f"ttft.{k}": getattr(out.ttft, k) for k in TTFT_FIELDS},
                        }
                    )
                    if self.metrics:
                        self.metrics.ttft.labels(request.model_id, arrival).observe(out.ttft.total_ms / 1e3)
                if out.HasField("usage"):
                    span.set_attributes(
                        {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens}
                    )
                if self.metrics:
                    self.metrics.tokens.labels(request.model_id).inc()
                    if last_ms is not None:
                        self.metrics.itl.labels(request.model_id).observe((out.elapsed_ms - last_ms) / 1e3)
                last_ms = out.elapsed_ms
                yield out
        except BaseException as e:
            status = "CANCELLED" if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else status_of(e).name
            raise
        finally:
            if self.metrics:
                self.metrics.requests.labels(request.model_id, status).inc()

    async def _generate(self, request, context):
        sp = request.sampling
        remaining = context.time_remaining()
        params = GenerateParams(
            model_id=request.model_id,
            prompt=request.prompt,
            max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            stop=tuple(sp.stop),
            seed=sp.seed,
            request_id=request.request_id,
            deadline=None if remaining is None else time.monotonic() + remaining,
            principal=current_principal(),
        )
        async for ev in self.router.generate(params):
            m = ev.msg
            out = pb.GenerateResponse(
                token_id=m.token_id, text=m.text, elapsed_ms=ev.elapsed_ms, finish_reason=m.finish_reason
            )
            if m.HasField("usage"):
                out.usage.CopyFrom(m.usage)
            if ev.first is not None:
                f = ev.first
                out.worker, out.arrival_state = f.worker, ARRIVAL[f.arrival]
                out.ttft.CopyFrom(
                    gen_pb.TtftBreakdown(
                        queue_ms=f.queue_ms,
                        delta_load_ms=m.ttft.delta_load_ms,
                        schedule_ms=m.ttft.schedule_ms,
                        prefill_ms=m.ttft.prefill_ms,
                        total_ms=f.total_ms,
                    )
                )
            yield out

    async def ListModels(self, request, context):
        who = current_principal()  # with tokens on: only the models this token may use
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    model_id=e.variant.model_id,
                    base_model=e.variant.base_model,
                    delta_bytes=e.variant.delta_bytes,
                    resident_on=e.resident_on,
                    servable=e.servable,
                    reason=e.reason,
                    in_flight=e.in_flight,
                    loading_on=e.loading_on,
                    base_fingerprint=e.variant.base_fingerprint,
                    is_base=e.variant.is_base,
                )
                for e in await self.router.models()
                if who is None or who.may_use(e.variant.model_id, e.variant.is_base)
            ]
        )

    async def ListWorkers(self, request, context):
        return pb.ListWorkersResponse(
            workers=[
                pb.WorkerInfo(
                    address=w.address,
                    up=w.up,
                    reason=w.reason,
                    device=w.device,
                    resident=sorted(w.resident),
                    in_flight=w.in_flight,
                    capacity=w.capacity,
                    delta_used_bytes=w.used_bytes,
                    delta_budget_bytes=w.budget_bytes,
                )
                for w in self.router.workers()
            ]
        )


def build_router(config: RouterConfig) -> Router:
    tls = config.channel_credentials()  # TLS on: the router's certificate for its calls, else None
    store = DeltaStoreClient(config.delta_store, timeout_s=config.call_timeout_s, credentials=tls)
    pool = WorkerPool(
        config.workers,
        capacity=config.max_in_flight_per_worker,
        poll_s=config.poll_s,
        call_timeout_s=config.call_timeout_s,
        credentials=tls,
    )
    return Router(config, pool, Registry(store, refresh_s=config.refresh_s, call_timeout_s=config.call_timeout_s))


def create_server(router: Router, address: str, metrics: RouterMetrics | None = None) -> Server:
    """A server for `router` bound to `address` (port 0 picks a free port); not started."""
    servicer = RouterServicer(router, metrics)
    service = Service(SERVICE, lambda s: pb_grpc.add_RouterServiceServicer_to_server(servicer, s))
    c = router.config
    return create_rpc_server(
        address,
        [service],
        serving=False,
        max_message_bytes=MAX_MESSAGE_BYTES,
        open_while_draining=("ListModels", "ListWorkers"),
        credentials=c.server_credentials(),
        interceptors=[AuthInterceptor([SERVICE], c.tokens(), ROLES, default=Role.USER)],
        health_address=c.health_address,
    )


async def close_router(router: Router) -> None:
    await router.close()
    await router.registry.store.close()


async def serve(config: RouterConfig) -> None:
    telemetry.setup("router", config.otlp_endpoint, instance=config.address)
    router = build_router(config)
    metrics = RouterMetrics(
        queue_depth=lambda: len(router.admission), in_flight=lambda: {(k,): v for k, v in router.in_flight.items()}
    )
    if config.metrics_address:
        metrics.serve(config.metrics_address)
    server = create_server(router, config.address, metrics)
    log.info(
        "router listening on %s (port %d); workers %s; delta store %s",
        config.address,
        server.port,
        ",".join(config.workers),
        config.delta_store,
    )
    try:
        await run_until_signal(server, config.grace_s, startup=router.start(), on_stop=lambda: close_router(router))
    finally:
        metrics.close()
        telemetry.shutdown()
