"""Traces for every service, set up once here: W3C trace context over gRPC, OTLP export.

    telemetry.setup("router", otlp_endpoint=config.otlp_endpoint, instance=config.address)
    ...                                    # serve; spans of one request form ONE trace
    telemetry.shutdown()                   # flush what is queued (bounded wait)

- `ServerInterceptor` (installed by `bitdelta.rpc.serve.create_server` on every server) reads
  `traceparent` from the call's metadata and runs the method inside a SERVER span named
  `<service>.<Method>` (`router.Generate`, `worker.Generate`, `delta_store.Fetch`); an error is
  recorded on the span with its status code. Health and reflection are never traced, and the
  polling methods (`POLL_METHODS`) only when the caller sent a trace context, so Status polls do
  not fill the trace store with one-span traces.
- `client_interceptors()` (passed by every client in `bitdelta.rpc.clients` to its channel) write
  the current span's context into each call's metadata (`traceparent`, `tracestate`).
- Export: OTLP over gRPC to `--otlp-endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`; neither set: no
  exporter at all (spans are still made, so context still propagates). Sampling follows the
  SDK's standard `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default: parentbased_always_on).
  A collector that is down costs a request nothing: spans go through a BatchSpanProcessor whose
  queue is bounded (`MAX_QUEUE` spans; beyond it spans are dropped) and whose exports run on its
  own thread with a short timeout.
- `traceparent()` / `context_of(tp)`: the trace context as a W3C string, for a hop that is not
  gRPC (rank 0 -> the tensor-parallel ranks' loads).
- `record_span(name, start_ns, end_ns, attributes)`: a span made after the fact from recorded
  timestamps (the worker's engine thread records times; the loop makes its spans).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger("bitdelta.rpc.telemetry")
TRACER_NAME = "bitdelta"
MAX_QUEUE = 4096  # spans waiting for export; beyond this, new spans are dropped (never blocks)
EXPORT_TIMEOUT_S = 5.0  # one export attempt to the collector
SCHEDULE_DELAY_MS = 1000
POLL_METHODS = frozenset({"Status", "List", "ListModels", "ListWorkers"})
SHORT = {"RouterService": "router", "GpuWorkerService": "worker", "DeltaStoreService": "delta_store"}

_provider = None  # the SDK TracerProvider `setup` installed in this process


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def span_name(method: str) -> str:
    """'/bitdelta.router.v1.RouterService/Generate' -> 'router.Generate'."""
    service, _, short = method.lstrip("/").partition("/")
    svc = service.rsplit(".", 1)[-1]
    return f"{SHORT.get(svc, re.sub(r'Service$', '', svc))}.{short}"


def endpoint_from(flag: str = "", env: Mapping[str, str] | None = None) -> str:
    """The OTLP endpoint: the service's flag, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
    OTEL_EXPORTER_OTLP_ENDPOINT; '' when none is set (then nothing is exported)."""
    env = os.environ if env is None else env
    return flag or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def setup(service: str, otlp_endpoint: str = "", *, instance: str = "", exporter=None):
    """Install this process's TracerProvider for `service` (resource `service.name`). Exports to
    `otlp_endpoint` (or the standard variables) over OTLP/gRPC; `exporter` overrides (tests).
    Returns the provider. Idempotent per process (a second call returns the first provider)."""
    global _provider
    if _provider is not None:
        return _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"bitdelta-{service}"}
    if instance:
        attrs["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler: OTEL_TRACES_SAMPLER (SDK default)
    endpoint = endpoint_from(otlp_endpoint)
    if exporter is None and endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=EXPORT_TIMEOUT_S)
    if exporter is not None:
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=MAX_QUEUE,
                schedule_delay_millis=SCHEDULE_DELAY_MS,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1e3,
            )
        )
        log.info(
            "traces: exporting OTLP/gRPC to %s (sampler %s)",
            endpoint or type(exporter).__name__,
            os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"),
        )
    else:
        log.info(
            "traces: no OTLP endpoint configured (--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT); nothing is exported"
        )
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown(timeout_s: float = EXPORT_TIMEOUT_S) -> None:
    """Flush queued spans (at most `timeout_s`) and stop the exporter thread."""
    if _provider is None:
        return
    try:
        _provider.force_flush(int(timeout_s * 1e3))
    finally:
        _provider.shutdown()


def record_span(
    name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None, parent: trace.Span | None = None
) -> None:
    """A finished span with explicit times, child of `parent` (default: the current span)."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    span = tracer().start_span(name, context=ctx, start_time=int(start_ns), attributes=dict(attributes or {}))
    span.end(end_time=max(int(start_ns), int(end_ns)))


def traceparent() -> str:
    """The current span's W3C `traceparent` ('' outside a recording span): to carry a trace to a
    process that is not called over gRPC (the tensor-parallel ranks get it in their LoadOp)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def context_of(traceparent: str) -> otel_context.Context | None:
    """The context a `traceparent()` string names (None for '': a new trace)."""
    return propagate.extract({"traceparent": traceparent}) if traceparent else None


def set_error(span: trace.Span, code: grpc.StatusCode | None, e: BaseException | None) -> None:
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_attribute("rpc.grpc.status", code.name)
    if e is not None and not isinstance(e, grpc.aio.AbortError):
        span.record_exception(e)
    if code not in (None, grpc.StatusCode.OK):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {e}" if e is not None else code.name))


# -- server side -------------------------------------------------------------------------------------
class _Getter:
    @staticmethod
    def get(carrier, key):
        v = [val for k, val in carrier if k == key]
        return v or None

    @staticmethod
    def keys(carrier):
        return [k for k, _ in carrier]


def _extract(context) -> otel_context.Context | None:
    md = tuple(context.invocation_metadata() or ())
    if not any(k == "traceparent" for k, _ in md):
        return None
    return propagate.extract(md, getter=_Getter)


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per call of the domain services' methods (never health or reflection)."""

    def __init__(self, services):
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(self.prefixes):
            return handler
        name, poll = span_name(method), method.rsplit("/", 1)[1] in POLL_METHODS
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method, name, poll), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, method, name, poll), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, method, name, poll), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, method, name, poll), **kw)

    @staticmethod
    def _start(context, method: str, name: str, poll: bool):
        parent = _extract(context)
        if parent is None and poll:
            return None
        service = method.lstrip("/").split("/")[0]
        return tracer().start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method.rsplit("/", 1)[1]},
        )

    @staticmethod
    def _finish(span, context, e: BaseException | None) -> None:
        code = None
        try:
            code = context.code()
        except Exception:
            pass
        if e is not None and isinstance(e, BaseException) and code in (None, grpc.StatusCode.OK):
            from bitdelta.rpc.errors import status_of

            code = grpc.StatusCode.CANCELLED if isinstance(e, (GeneratorExit,)) else status_of(e)
        set_error(span, code if code is not None else grpc.StatusCode.OK, e)
        span.end()

    def _unary(self, fn, method: str, name: str, poll: bool):
        async def call(request, context):
            span = self._start(context, method, name, poll)
            if span is None:
                return await fn(request, context)
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                out = await fn(request, context)
            except BaseException as e:
                self._finish(span, context, e)
                raise
            else:
                self._finish(span, context, None)
                return out
            finally:
                otel_context.detach(token)

        return call

    def _stream(self, fn, method: str, name: str, poll: bool):
        async def call(request, context):
            span = self._start(context, method, name, poll)
            if span is None:
                async for r in fn(request, context):
                    yield r
                return
            ctx = trace.set_span_in_context(span)
            token = otel_context.attach(ctx)
            n = 0
            try:
                async for r in fn(request, context):
                    n += 1
                    otel_context.detach(token)  # the caller's own context while suspended at yield
                    token = None
                    yield r
                    token = otel_context.attach(ctx)
            except BaseException as e:
                span.set_attribute("rpc.messages_sent", n)
                self._finish(span, context, e)
                raise
            else:
                span.set_attribute("rpc.messages_sent", n)
                self._finish(span, context, None)
            finally:
                if token is not None:
                    otel_context.detach(token)

        return call


# -- client side -------------------------------------------------------------------------------------
def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    md = grpc.aio.Metadata(*(tuple(details.metadata or ())))
    for k, v in carrier.items():
        md.add(k, v)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials, details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_context(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_context(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_context(details), request_iterator)


def client_interceptors() -> list:
    """Interceptors for a `grpc.aio` channel that carry the current trace context to the callee."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary()]
