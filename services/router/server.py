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
from collections.abc import Sequence

from bitdelta.generation import ArrivalState, Request, TokenEvent, fill_stream_pb
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
from services.router.router import Router

log = logging.getLogger("services.router.server")
SERVICE = pb.DESCRIPTOR.services_by_name["RouterService"].full_name
MAX_MESSAGE_BYTES = 64 << 20
# With --tokens-file: every method needs a known token; ListWorkers (the workers' addresses and load) an admin one.
ROLES = {"ListWorkers": Role.ADMIN}
ARRIVAL_PB = {
    ArrivalState.BASE: pb.ARRIVAL_STATE_UNSPECIFIED,
    ArrivalState.RESIDENT: pb.ARRIVAL_STATE_RESIDENT,
    ArrivalState.LOADING: pb.ARRIVAL_STATE_LOADING,
    ArrivalState.COLD: pb.ARRIVAL_STATE_COLD,
}


def events_to_pb(events: Sequence[TokenEvent]) -> pb.GenerateResponse:
    """One stream message holding `events` (every token ready when it is written)."""
    return fill_stream_pb(events, pb.GenerateResponse(worker=events[0].worker), ARRIVAL_PB)


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, router: Router, metrics: RouterMetrics | None = None):
        self.router, self.metrics = router, metrics

    async def Generate(self, request, context):
        remaining = context.time_remaining()
        req = Request.from_pb(request, None if remaining is None else time.monotonic() + remaining)
        status, last_ms, m = "OK", None, self.metrics  # instrumentation: metrics and the span's attributes
        span = telemetry.trace.get_current_span()
        span.set_attribute("model_id", request.model_id)
        try:
            async for ready in self.router.generate(req, principal=current_principal()):
                ev = ready[0]
                if ev.ttft is not None:
                    t = ev.ttft
                    span.set_attributes(
                        {
                            "worker": ev.worker,
                            "arrival_state": ev.arrival.value,
                            "ttft.queue_ms": t.queue_ms,
                            "ttft.delta_load_ms": t.delta_load_ms,
                            "ttft.schedule_ms": t.schedule_ms,
                            "ttft.prefill_ms": t.prefill_ms,
                            "ttft.total_ms": t.total_ms,
                        }
                    )
                    if m:
                        m.ttft.labels(request.model_id, ev.arrival.value).observe(t.total_ms / 1e3)
                for ev in ready:
                    if ev.usage is not None:
                        span.set_attributes(
                            {"prompt_tokens": ev.usage.prompt_tokens, "completion_tokens": ev.usage.completion_tokens}
                        )
                    if m and last_ms is not None:
                        m.itl.labels(request.model_id).observe((ev.elapsed_ms - last_ms) / 1e3)
                    last_ms = ev.elapsed_ms
                if m:
                    m.tokens.labels(request.model_id).inc(len(ready))
                yield events_to_pb(ready)
        except BaseException as e:
            status = "CANCELLED" if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else status_of(e).name
            raise
        finally:
            if m:
                m.requests.labels(request.model_id, status).inc()

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
                    chat_template=e.variant.chat_template.to_pb() if e.variant.chat_template else None,
                    sampling_defaults=e.variant.sampling.to_pb() if e.variant.sampling else None,
                    tokenizer_sha256=e.variant.tokenizer_sha256,
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
        public=True,  # its callers are outside the deployment: no worker's or store's address in an error
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
