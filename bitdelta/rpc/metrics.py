"""Prometheus metrics of the services: names in one place, one registry per service instance,
an HTTP `/metrics` endpoint (`--metrics-address HOST:PORT`; empty, the default: no endpoint).

    m = RouterMetrics(queue_depth=lambda: len(router.admission))
    m.serve("0.0.0.0:9400")                    # -> the bound port (0 picks a free one)
    m.requests.labels(model_id="coder", status="OK").inc()

Events (requests, tokens, latencies) are counted where they happen; levels and counters the
core already keeps (queue depth, resident deltas, loads started, cache stats) are read at scrape
time through callables, so the core carries no metric objects. Names follow Prometheus
conventions: base units in the name (`_seconds`, `_bytes`), `_total` on counters. Imports no
service; the services pass their callables in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("bitdelta.rpc.metrics")

# TTFT from a resident delta is tens of ms, a cold load of a 70B delta seconds: 5 ms .. 60 s.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)

Reading = Callable[[], float] | Callable[[], Mapping[tuple[str, ...], float]]


class _Readings:
    """Gauges and counters whose values the core already keeps, read at scrape time."""

    def __init__(self):
        self.items: list[tuple[str, str, str, tuple[str, ...], Reading]] = []

    def add(self, kind: str, name: str, doc: str, fn: Reading, labels: tuple[str, ...] = ()) -> None:
        self.items.append((kind, name, doc, labels, fn))

    def collect(self) -> Iterable:
        for kind, name, doc, labels, fn in self.items:
            try:
                value = fn()
            except Exception:
                log.exception("metric %s could not be read", name)
                continue
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)
            if labels:
                for key, v in sorted(value.items()):
                    family.add_metric(list(key), float(v))
            else:
                family.add_metric([], float(value))
            yield family


class ServiceMetrics:
    """A registry of one service instance plus its scrape-time readings."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.readings = _Readings()
        self.registry.register(self.readings)
        self._server = None

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...], buckets) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def serve(self, address: str) -> int:
        """Serve `/metrics` on HOST:PORT (a thread); returns the port."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        self._server, thread = start_http_server(int(port), addr=host, registry=self.registry)
        bound = self._server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RouterMetrics(ServiceMetrics):
    def __init__(self, queue_depth: Callable[[], float], in_flight: Callable[[], Mapping]):
        super().__init__()
        self.requests = self.counter(
            "bitdelta_router_requests_total",
            "Generate requests that ended, by model and gRPC status",
            ("model_id", "status"),
        )
        self.ttft = self.histogram(
            "bitdelta_router_ttft_seconds",
            "time to first token at the router",
            ("model_id", "arrival_state"),
            TTFT_BUCKETS,
        )
        self.itl = self.histogram(
            "bitdelta_router_inter_token_seconds", "time between streamed tokens", ("model_id",), ITL_BUCKETS
        )
        self.tokens = self.counter("bitdelta_router_tokens_total", "tokens streamed to clients", ("model_id",))
        self.readings.add(
            "gauge", "bitdelta_router_queue_depth", "requests waiting for a worker with room", queue_depth
        )
        self.readings.add(
            "gauge",
            "bitdelta_router_in_flight_requests",
            "requests admitted and not finished",
            in_flight,
            ("model_id",),
        )


class GatewayMetrics(ServiceMetrics):
    """The gateway's HTTP requests (served at its own `/metrics` route). `model` is a model the
    router served or listed, else "other": a client cannot grow the series with made-up ids."""

    def __init__(self):
        super().__init__()
        self.requests = self.counter(
            "bitdelta_gateway_requests_total",
            "HTTP requests that ended, by route, model and status",
            ("route", "model", "status"),
        )
        self.latency = self.histogram(
            "bitdelta_gateway_request_seconds", "HTTP request to its last byte", ("route", "model"), TTFT_BUCKETS
        )
        self.errors = self.counter(
            "bitdelta_gateway_errors_total", "HTTP requests answered 4xx or 5xx, by route and model", ("route", "model")
        )


class WorkerMetrics(ServiceMetrics):
    def __init__(self, worker_state: Callable[[], Mapping[str, float]]):
        """`worker_state()` -> {resident_deltas, delta_used_bytes, delta_budget_bytes, loads, evictions,
        kv_blocks_used, kv_blocks_total, running, waiting, prefill_tokens, preemptions, prefix_cache_queries,
        prefix_cache_hits, tensor_parallel, tp_collectives}."""
        super().__init__()
        self.requests = self.counter(
            "bitdelta_worker_requests_total",
            "Generate requests that ended, by model and gRPC status",
            ("model_id", "status"),
        )
        self.ttft = self.histogram(
            "bitdelta_worker_ttft_seconds",
            "time to first token inside the worker",
            ("model_id", "arrival_state"),
            TTFT_BUCKETS,
        )
        self.itl = self.histogram(
            "bitdelta_worker_inter_token_seconds", "time between tokens of one sequence", ("model_id",), ITL_BUCKETS
        )
        self.tokens = self.counter("bitdelta_worker_tokens_total", "tokens generated", ("model_id",))
        self.load_seconds = self.histogram(
            "bitdelta_worker_delta_load_seconds", "time to stream one delta into a slot", (), LOAD_BUCKETS
        )
        st = worker_state
        for kind, name, key, doc in [
            ("gauge", "bitdelta_worker_resident_deltas", "resident_deltas", "deltas resident in device slots"),
            ("gauge", "bitdelta_worker_delta_used_bytes", "delta_used_bytes", "device bytes held by deltas"),
            ("gauge", "bitdelta_worker_delta_budget_bytes", "delta_budget_bytes", "device bytes for deltas"),
            ("counter", "bitdelta_worker_delta_loads_total", "loads", "delta loads started"),
            ("counter", "bitdelta_worker_delta_evictions_total", "evictions", "deltas evicted from their slots"),
            ("gauge", "bitdelta_worker_kv_blocks_used", "kv_blocks_used", "KV cache blocks in use"),
            ("gauge", "bitdelta_worker_kv_blocks", "kv_blocks_total", "KV cache blocks in all"),
            ("gauge", "bitdelta_worker_running_sequences", "running", "sequences in the batch"),
            ("gauge", "bitdelta_worker_waiting_sequences", "waiting", "sequences waiting for the batch"),
            (
                "counter",
                "bitdelta_worker_prefill_tokens_total",
                "prefill_tokens",
                "prompt tokens put through the model (the choices of one request share one prefill)",
            ),
            (
                "counter",
                "bitdelta_worker_preemptions_total",
                "preemptions",
                "sequences preempted for KV blocks or a better priority (freed, recomputed later)",
            ),
            (
                "counter",
                "bitdelta_worker_prefix_cache_queries_total",
                "prefix_cache_queries",
                "tokens of admitted sequences looked up in the prefix cache",
            ),
            (
                "counter",
                "bitdelta_worker_prefix_cache_hits_total",
                "prefix_cache_hits",
                "tokens found in the prefix cache (their KV blocks shared, not computed again)",
            ),
            (
                "gauge",
                "bitdelta_worker_tensor_parallel_ranks",
                "tensor_parallel",
                "ranks of this worker (1: one process)",
            ),
            (
                "counter",
                "bitdelta_worker_tp_collectives_total",
                "tp_collectives",
                "collectives between the tensor-parallel ranks (broadcasts, all-reduces, gathers)",
            ),
        ]:
            self.readings.add(
                kind, name.removesuffix("_total") if kind == "counter" else name, doc, lambda key=key: st()[key]
            )


class StoreMetrics(ServiceMetrics):
    def __init__(
        self,
        cache_stats: Callable[[], Mapping[str, int]],
        cache_used_bytes: Callable[[], float],
        transports: Callable[[], Mapping[str, int]] = dict,
    ):
        super().__init__()
        self.fetches = self.counter("bitdelta_delta_store_fetches_total", "Fetch calls opened, by delta", ("delta",))
        self.bytes_served = self.counter("bitdelta_delta_store_served_bytes_total", "delta bytes streamed by Fetch")
        self.requests = self.counter(
            "bitdelta_delta_store_requests_total", "calls that ended, by method and status", ("method", "status")
        )
        self.readings.add(
            "counter",
            "bitdelta_delta_store_cache_events",
            "host cache outcomes: hit, miss, join (a load in progress), bypass, eviction",
            lambda: {(k,): v for k, v in cache_stats().items()},
            ("result",),
        )
        self.readings.add("gauge", "bitdelta_delta_store_cache_used_bytes", "host cache bytes in use", cache_used_bytes)
        self.readings.add(
            "counter",
            "bitdelta_delta_store_fetch_transports",
            "Fetch calls by how their bytes travel: stream, or shared-memory (same-host workers)",
            lambda: {(k,): v for k, v in transports().items()},
            ("transport",),
        )
