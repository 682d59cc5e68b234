"""gRPC surface of the worker: the servicer (protobuf ↔ domain only), one
interceptor that maps exceptions to status codes, health and reflection, and
the process lifecycle (SIGTERM → NOT_SERVING → stop(grace)).

    worker = Worker(config)
    server, port = await create_server(worker, "127.0.0.1:0")   # port 0 in tests
    await server.start(); await start_worker(worker, server)     # health SERVING once the base is loaded
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from bitdelta.common.v1 import generation_pb2
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from services.gpu_worker.errors import status_of
from services.gpu_worker.manager import DeltaState, SlotInfo
from services.gpu_worker.worker import GenerateParams, Worker

log = logging.getLogger("gpu_worker.server")
SERVICE = pb.DESCRIPTOR.services_by_name["GpuWorkerService"].full_name

FINISH = {
    "length": generation_pb2.FINISH_REASON_LENGTH, "eos": generation_pb2.FINISH_REASON_EOS,
    "stop": generation_pb2.FINISH_REASON_STOP, "cancelled": generation_pb2.FINISH_REASON_CANCELLED,
}  # fmt: skip
STATES = {
    DeltaState.ABSENT: pb.DELTA_STATE_ABSENT, DeltaState.LOADING: pb.DELTA_STATE_LOADING,
    DeltaState.RESIDENT: pb.DELTA_STATE_RESIDENT, DeltaState.EVICTING: pb.DELTA_STATE_EVICTING,
    DeltaState.FAILED: pb.DELTA_STATE_FAILED,
}  # fmt: skip


def slot_to_pb(s: SlotInfo) -> pb.DeltaSlot:
    return pb.DeltaSlot(name=s.name, state=STATES[s.state], bytes=s.bytes, pinned=s.pinned,
                        request_rate=s.request_rate, error=s.error)  # fmt: skip


class GpuWorkerServicer(pb_grpc.GpuWorkerServiceServicer):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def Generate(self, request, context):
        sp = request.sampling
        remaining = context.time_remaining()
        params = GenerateParams(
            model_id=request.model_id, prompt=request.prompt, max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature, top_p=sp.top_p, stop=list(sp.stop), seed=sp.seed,
            request_id=request.request_id,
            deadline=None if remaining is None else time.monotonic() + remaining,
        )  # fmt: skip
        async for ev in self.worker.generate(params):
            msg = pb.GenerateResponse(token_id=ev.token_id, text=ev.text, elapsed_ms=ev.elapsed_ms)
            if ev.ttft is not None:
                msg.ttft.CopyFrom(generation_pb2.TtftBreakdown(**ev.ttft))
            if ev.finish_reason is not None:
                msg.finish_reason = FINISH[ev.finish_reason]
                msg.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=ev.prompt_tokens,
                                                        completion_tokens=ev.completion_tokens))
            yield msg

    async def LoadDelta(self, request, context):
        info, waited = await self.worker.load_delta(request.name, pin=request.pin)
        return pb.LoadDeltaResponse(slot=slot_to_pb(info), load_ms=waited)

    async def EvictDelta(self, request, context):
        state = await self.worker.evict_delta(request.name)
        return pb.EvictDeltaResponse(state=STATES[state])

    async def Status(self, request, context):
        s = self.worker.status()
        return pb.StatusResponse(
            base_model=s.base_model, base_fingerprint=s.base_fingerprint, device=s.device,
            slots=[slot_to_pb(x) for x in s.slots], delta_budget_bytes=s.delta_budget_bytes,
            delta_used_bytes=s.delta_used_bytes, running=s.running, waiting=s.waiting,
            kv_tokens_used=s.kv_tokens_used, kv_tokens_total=s.kv_tokens_total,
        )  # fmt: skip


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Every exception a handler raises becomes a status code with its message (see errors.status_of)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    return await inner(request, context)
                except Exception as e:  # noqa: BLE001
                    await _abort(context, method, e)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            async def stream(request, context):
                try:
                    async for msg in inner_s(request, context):
                        yield msg
                except Exception as e:  # noqa: BLE001
                    await _abort(context, method, e)

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


async def _abort(context, method: str, e: Exception):
    if isinstance(e, grpc.aio.AbortError):
        raise e
    code = status_of(e)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=e)
    else:
        log.info("%s: %s: %s", method, code.name, e)
    await context.abort(code, str(e) or type(e).__name__)


async def create_server(worker: Worker, address: str) -> tuple[grpc.aio.Server, int]:
    """A server for `worker` bound to `address` (port 0 picks a free port); not started.

    Health reports NOT_SERVING until `start_worker` has loaded the base.
    """
    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_GpuWorkerServiceServicer_to_server(GpuWorkerServicer(worker), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for name in ("", SERVICE):
        await hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    server.health = hs  # for start_worker / drain
    return server, port


async def set_health(server, serving: bool) -> None:
    st = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await server.health.set(name, st)


async def start_worker(worker: Worker, server) -> None:
    """Load the base, then report SERVING."""
    await worker.start()
    await set_health(server, True)


async def begin_drain(worker: Worker, server) -> None:
    """Health NOT_SERVING and new requests refused (UNAVAILABLE); running streams go on."""
    worker.begin_drain()
    await set_health(server, False)


async def drain_and_stop(worker: Worker, server, grace_s: float) -> None:
    """Drain, let running streams finish for up to `grace_s`, stop."""
    await begin_drain(worker, server)
    await server.stop(grace_s)
    await worker.close()


async def serve(config) -> None:
    """The process: bind, load the base, serve until SIGTERM/SIGINT, drain."""
    worker = Worker(config)
    server, port = await create_server(worker, config.address)
    await server.start()
    log.info("gpu_worker listening on %s (port %d); loading base %s", config.address, port, config.base)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starter = asyncio.create_task(start_worker(worker, server))
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({starter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if starter in done and starter.exception() is not None:
        log.error("could not start: %s", starter.exception())
        await server.stop(0)
        raise SystemExit(1)
    await stopper
    log.info("draining (grace %.0f s)", config.grace_s)
    starter.cancel()
    await drain_and_stop(worker, server, config.grace_s)
