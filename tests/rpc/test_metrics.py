"""The Prometheus endpoints (`--metrics-address`) of store, worker and router, scraped from running
processes: the counters move with real requests, and the text parses as Prometheus exposition."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from bitdelta.rpc.clients.router import RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.rpc.errors import RpcError
from bitdelta.testing.cluster import Cluster, free_port
from bitdelta.testing.family import make_test_family
from tests.support.metrics import scrape

pytestmark = pytest.mark.asyncio(loop_scope="module")


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: dict, name: str, **labels) -> float:
    """Sum over the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("metrics")
    fam = make_test_family(work / "family", n_variants=2, merged=False)
    root = work / "deltas"
    shutil.copytree(fam.deltas, root)
    with Cluster(work) as c:
        c.family = fam
        c.ports = {k: free_port() for k in ("store", "worker", "router")}
        flag = lambda k: ("--metrics-address", f"127.0.0.1:{c.ports[k]}")
        c.st = c.store(root, extra=flag("store"))
        c.w = c.worker(fam.base, c.st.address, extra=("--max-slots", "1", *flag("worker")))
        c.r = c.router([c.w.address], c.st.address, extra=flag("router"))
        c.wait_serving(c.st, c.w, c.r)
        yield c


async def test_counters_move_on_every_endpoint(cluster):
    fam = cluster.family
    before = {k: scrape(p) for k, p in cluster.ports.items()}
    async with RouterClient(cluster.r.address, generate_timeout_s=120) as r:
        deadline = time.monotonic() + 60
        while not (
            all(w.up for w in await r.list_workers())
            and sum(m.servable and not m.is_base for m in await r.list_models()) >= 2
        ):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        for v in (fam.variants[0], fam.variants[1], fam.variants[0]):  # one slot: one delta at a time
            msgs = [m async for m in r.generate(v, "The quick brown fox", max_new_tokens=5)]
            assert msgs[-1].tokens[-1].finish_reason != 0
        with pytest.raises(RpcError):
            [m async for m in r.generate("nope", "hi", max_new_tokens=1)]
    async with WorkerClient(cluster.w.address) as w:
        st = await w.status()
    after = {k: scrape(p) for k, p in cluster.ports.items()}
    ro, wo, so = after["router"], after["worker"], after["store"]
    rb, wb, sb = before["router"], before["worker"], before["store"]
    v0 = fam.variants[0]

    # router: requests by variant and status, tokens, TTFT by arrival state, inter-token latency
    assert (
        value(ro, "bitdelta_router_requests_total", model_id=v0, status="OK")
        - value(rb, "bitdelta_router_requests_total", model_id=v0, status="OK")
        == 2
    )
    assert value(ro, "bitdelta_router_requests_total", model_id="nope", status="NOT_FOUND") == 1
    assert value(ro, "bitdelta_router_tokens_total", model_id=v0) == 10
    assert total(ro, "bitdelta_router_ttft_seconds_count", model_id=v0, arrival_state="cold") >= 1
    assert total(ro, "bitdelta_router_inter_token_seconds_count", model_id=v0) == 8
    assert value(ro, "bitdelta_router_queue_depth") == 0

    # worker: tokens, TTFT, loads and evictions (one slot), residency, KV blocks
    assert value(wo, "bitdelta_worker_tokens_total", model_id=v0) == 10
    assert value(wo, "bitdelta_worker_delta_loads_total") == st.loads_started >= 3
    assert value(wo, "bitdelta_worker_delta_evictions_total") >= 2
    assert value(wo, "bitdelta_worker_delta_load_seconds_count") >= 3
    assert value(wo, "bitdelta_worker_resident_deltas") == 1
    assert value(wo, "bitdelta_worker_delta_used_bytes") == st.delta_used_bytes > 0
    assert value(wo, "bitdelta_worker_delta_budget_bytes") == 8 << 20
    assert value(wo, "bitdelta_worker_kv_blocks") > 0 and value(wo, "bitdelta_worker_kv_blocks_used") == 0
    assert value(wb, "bitdelta_worker_tokens_total", model_id=v0) == 0

    # store: fetches by delta, cache misses then hits, bytes served
    assert value(so, "bitdelta_delta_store_fetches_total", delta=v0) == 2
    assert value(so, "bitdelta_delta_store_cache_events_total", result="miss") >= 2
    assert value(so, "bitdelta_delta_store_cache_events_total", result="hit") >= 1
    assert (
        value(so, "bitdelta_delta_store_served_bytes_total") - value(sb, "bitdelta_delta_store_served_bytes_total")
        >= 3 * 1000
    )
    assert value(so, "bitdelta_delta_store_cache_used_bytes") > 0


async def test_no_metrics_flag_no_endpoint():
    from services.router.config import RouterConfig

    c = RouterConfig.from_args(["--workers", "a:1", "--delta-store", "b:2"], env={})
    assert c.metrics_address == "" and c.otlp_endpoint == ""
    with pytest.raises(Exception, match="metrics-address"):
        RouterConfig.from_args(["--workers", "a:1", "--delta-store", "b:2", "--metrics-address", "9400"], env={})
