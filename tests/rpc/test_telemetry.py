"""Traces end to end: store, worker and router as separate processes export OTLP/gRPC to the real
`rotel` collector (PyPI), which forwards to an OTLP sink this test runs (`bitdelta.traces.OtlpFileSink`,
writing OTLP/JSON lines). One request is one trace with the TTFT breakdown as spans and attributes;
`bitdelta traces ttft` reads the file. And a collector that is down costs a request nothing.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import pytest_asyncio

from bitdelta import traces
from bitdelta.cli import main as cli_main
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.testing.cluster import Cluster, free_port
from bitdelta.testing.family import make_test_family

pytestmark = pytest.mark.asyncio(loop_scope="module")
T = 120


def rotel_binary() -> Path:
    import rotel

    return Path(rotel.__file__).parent / "rotel-agent"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("telemetry_family"), n_variants=2, merged=False)


@pytest.fixture(scope="module")
def traced(family, tmp_path_factory):
    """rotel on a loopback port forwarding to our sink; the three services export to rotel."""
    work = tmp_path_factory.mktemp("telemetry")
    sink = traces.OtlpFileSink(work / "spans.jsonl")
    rotel_port = free_port()
    rotel = subprocess.Popen(
        [
            str(rotel_binary()),
            "start",
            "--otlp-grpc-endpoint",
            f"127.0.0.1:{rotel_port}",
            "--otlp-http-endpoint",
            f"127.0.0.1:{free_port()}",
            "--exporter",
            "otlp",
            "--otlp-exporter-endpoint",
            f"http://127.0.0.1:{sink.port}",
            "--otlp-exporter-protocol",
            "grpc",
            "--batch-timeout",
            "100ms",
        ],
        stdout=open(work / "rotel.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rotel_port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    try:
        with Cluster(work, env=env) as c:
            c.sink, c.spans_file = sink, work / "spans.jsonl"
            c.st = c.store(root)
            c.w = c.worker(family.base, c.st.address)
            c.r = c.router([c.w.address], c.st.address)
            c.wait_serving(c.st, c.w, c.r)
            yield c
    finally:
        rotel.terminate()
        rotel.wait(timeout=30)
        sink.stop()


def spans_of(path: Path, trace_id: str) -> list[traces.Span]:
    return [s for s in traces.read_file(path) if s.trace_id == trace_id] if path.exists() else []


async def wait_trace(
    path: Path, want: set[str], timeout: float = 60, after: int = 0, requests: int = 1
) -> tuple[str, list[traces.Span]]:
    """The trace of the newest router.Generate span once `requests` of them started after `after` and
    every span named in `want` arrived in the newest (processes export on their own schedules: one
    request's spans can reach the sink before an earlier or later one's)."""
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            roots = [s for s in traces.read_file(path) if s.name == "router.Generate" and s.start_ns > after]
            if len(roots) >= requests:
                tid = max(roots, key=lambda s: s.start_ns).trace_id
                got = spans_of(path, tid)
                if want <= {s.name for s in got}:
                    return tid, got
        assert time.monotonic() < deadline, f"spans {want} did not all reach the sink through rotel"
        await asyncio.sleep(0.3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(traced):
    async with RouterClient(traced.r.address, generate_timeout_s=T) as r:
        await until_workers_up(r)
        yield r


async def until_workers_up(r: RouterClient, timeout: float = 60) -> None:
    """Workers up and the variants listed (the router refreshes them from the store every second)."""
    deadline = time.monotonic() + timeout
    while not (
        all(w.up for w in await r.list_workers())
        and sum(m.servable and not m.is_base for m in await r.list_models()) >= 2
    ):
        assert time.monotonic() < deadline, "the router never saw its workers up and the variants listed"
        await asyncio.sleep(0.1)


async def make_cold(traced, model: str) -> None:
    """`model` resident nowhere, whatever ran before: the next request for it loads it."""
    async with WorkerClient(traced.w.address) as w:
        await w.evict_delta(model)


async def test_one_cold_request_is_one_trace_through_rotel(traced, router, family):
    model = family.variants[0]  # the only test of this cluster that asks for it: the store's cache misses
    await make_cold(traced, model)
    msgs = [m async for m in router.generate(model, "The quick brown fox", max_new_tokens=6)]
    assert msgs[0].arrival_state == pb.ARRIVAL_STATE_COLD
    want = {
        "router.Generate",
        "router.placement",
        "worker.Generate",
        "worker.load_delta",
        "delta_store.Fetch",
        "delta_store.fetch",
        "delta_store.backend.read",
        "worker.schedule",
        "worker.prefill",
        "worker.decode",
    }
    tid, spans = await wait_trace(traced.spans_file, want)
    by = {s.name: s for s in spans}
    ids = {s.span_id: s for s in spans}

    def parent(name):
        return ids[by[name].parent_id].name

    # the tree: router -> worker -> load -> store, and the engine's parts under the worker's span
    assert by["router.Generate"].parent_id == ""
    assert parent("router.placement") == "router.Generate"
    assert parent("worker.Generate") == "router.Generate"
    assert parent("worker.load_delta") == "worker.Generate"
    assert parent("delta_store.Fetch") == "worker.load_delta"
    assert parent("delta_store.fetch") == "delta_store.Fetch"
    assert parent("delta_store.backend.read") == "delta_store.fetch"
    for name in ("worker.schedule", "worker.prefill", "worker.decode"):
        assert parent(name) == "worker.Generate"
    assert {s.service for s in spans} == {"bitdelta-router", "bitdelta-worker", "bitdelta-delta_store"}
    # attributes a person filters by
    r, w = by["router.Generate"].attrs, by["worker.Generate"].attrs
    assert r["model_id"] == model and r["arrival_state"] == "cold" and r["worker"] == traced.w.address
    assert r["completion_tokens"] == 6 and r["prompt_tokens"] > 0
    assert r["ttft.delta_load_ms"] > 0 and r["ttft.total_ms"] >= r["ttft.delta_load_ms"]
    assert w["arrival_state"] == "cold" and w["prefill.batch_size"] >= 1 and w["completion_tokens"] == 6
    delta_bytes = by["worker.load_delta"].attrs["delta.bytes"]
    assert delta_bytes > 0
    assert by["delta_store.fetch"].attrs["cache.hit"] is False and by["delta_store.fetch"].attrs["delta.bytes_sent"] > 0
    assert by["worker.decode"].attrs["completion_tokens"] == 6
    # the engine's parts in order, inside the worker's span
    sched, pre, dec = by["worker.schedule"], by["worker.prefill"], by["worker.decode"]
    assert by["worker.load_delta"].end_ns <= sched.start_ns + 2_000_000
    assert sched.end_ns == pre.start_ns and pre.end_ns == dec.start_ns <= dec.end_ns
    assert by["worker.Generate"].start_ns <= sched.start_ns and dec.end_ns <= by["worker.Generate"].end_ns + 2_000_000

    # the second request is resident: no load span, a router span saying so
    msgs = [m async for m in router.generate(model, "abc", max_new_tokens=3)]
    assert msgs[0].arrival_state == pb.ARRIVAL_STATE_RESIDENT
    tid2, spans2 = await wait_trace(
        traced.spans_file, {"router.Generate", "worker.decode"}, after=by["router.Generate"].start_ns
    )
    assert tid2 != tid and len(tid) == 32  # hex, as OTLP/JSON has it
    assert "worker.load_delta" not in {s.name for s in spans2}
    assert {s.attrs.get("arrival_state") for s in spans2 if s.name == "router.Generate"} == {"resident"}


async def test_errors_are_recorded_with_their_status(traced, router):
    with pytest.raises(Exception) as e:
        [m async for m in router.generate("no-such-variant", "hi", max_new_tokens=2)]
    assert "NOT_FOUND" in str(e.value) or "not found" in str(e.value).lower()
    deadline = time.monotonic() + 60
    while True:
        bad = [  # the file appears with the first span that reaches the sink (this test may run first)
            s
            for s in (traces.read_file(traced.spans_file) if traced.spans_file.exists() else ())
            if s.name == "router.Generate" and s.attrs.get("model_id") == "no-such-variant"
        ]
        if bad:
            break
        assert time.monotonic() < deadline, "the failed request's span did not arrive"
        await asyncio.sleep(0.3)
    assert bad[0].attrs["rpc.grpc.status"] == "NOT_FOUND"


async def test_traces_ttft_cli_reads_the_file(traced, router, family, tmp_path, capsys):
    model = family.variants[1]
    await make_cold(traced, model)
    t0 = time.time_ns()
    for _ in ("cold", "resident"):
        [m async for m in router.generate(model, "hello there", max_new_tokens=2)]
    await wait_trace(traced.spans_file, {"worker.decode"}, after=t0, requests=2)
    png = tmp_path / "ttft.png"
    assert cli_main(["traces", "ttft", "--from", str(traced.spans_file), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert model in out and "cold" in out and "resident" in out
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    rows = traces.summarise(traces.ttft_rows(traces.read_file(traced.spans_file)))
    cold = [r for r in rows if r["arrival_state"] == "cold"]
    assert cold and all(r["delta_load_ms_p50"] > 0 for r in cold)


async def test_a_collector_that_is_down_costs_a_request_nothing(family, tmp_path):
    """Two routers+workers on the same store: one exports to a port where nothing listens. Requests
    succeed, take no longer, and the exporter's queue stays bounded (the process's memory flat)."""
    root = tmp_path / "deltas"
    shutil.copytree(family.deltas, root)
    dead = f"http://127.0.0.1:{free_port()}"
    with Cluster(tmp_path / "a") as plain, Cluster(tmp_path / "b", env={"OTEL_EXPORTER_OTLP_ENDPOINT": dead}) as down:
        st = plain.store(root)
        plain.wait_serving(st)
        ws = [c.worker(family.base, st.address) for c in (plain, down)]
        rs = [c.router([w.address], st.address) for c, w in zip((plain, down), ws)]
        plain.wait_serving(*ws, *rs)
        model = family.variants[0]

        async def timed(address: str, n: int) -> list[float]:
            out = []
            async with RouterClient(address, generate_timeout_s=T) as r:
                await until_workers_up(r)
                [m async for m in r.generate(model, "warm", max_new_tokens=2)]
                for _ in range(n):
                    t = time.perf_counter()
                    msgs = [m async for m in r.generate(model, "The quick brown fox", max_new_tokens=4)]
                    assert msgs[-1].tokens[-1].finish_reason != 0
                    out.append(time.perf_counter() - t)
            return out

        def rss(p) -> int:
            return int(Path(f"/proc/{p.popen.pid}/status").read_text().split("VmRSS:")[1].split()[0])

        base_t = await timed(rs[0].address, 10)
        rss0 = rss(rs[1])
        down_t = await timed(rs[1].address, 10)
        down_t += await timed(rs[1].address, 30)
        rss1 = rss(rs[1])
        med = lambda xs: sorted(xs)[len(xs) // 2]
        # generous bound: the machine is shared; an exporter blocking the loop would cost seconds
        assert med(down_t) < 2 * med(base_t) + 0.05, (med(base_t), med(down_t))
        assert max(down_t) < 2.0, max(down_t)
        assert rss1 - rss0 < 20_000, f"router RSS grew {rss1 - rss0} kB with the collector down"
        assert all(p.alive() for p in (*ws, *rs))
        assert "traces: exporting OTLP/gRPC to " + dead in rs[1].log_text()
