"""The router end to end: a delta store, two workers and routers as separate processes on loopback
ports, a tiny random family (real checkpoints and delta files), the shared clients.

Correctness is "the same greedy tokens as the worker alone"; the worker itself is checked against
independent references in test_worker_service.py.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import time

import grpc
import pytest
import pytest_asyncio

from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.delta_store import DeltaStoreClient
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.testing.cluster import Cluster, free_port
from bitdelta.testing.family import make_test_family
from tests.support.metrics import sample

pytestmark = pytest.mark.asyncio(loop_scope="module")

N = 12  # new tokens per generation
T = 120  # deadline (s) of client calls: generous, the machine may be busy
PROMPTS = {"": "Hello world", "v0": "The quick brown fox", "v1": "abc xyz", "v2": "def f(x):"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    fam = make_test_family(tmp_path_factory.mktemp("router_family"), n_variants=3, merged=False)
    os.remove(fam.delta_path(fam.corrupt))  # corrupt deltas are the reliability suite's subject
    return fam


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    """Store (over a copy of the family's deltas), two workers, one router."""
    work = tmp_path_factory.mktemp("router_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    with Cluster(work) as c:
        c.root = root
        c.store_metrics_port = free_port()
        c.st = c.store(root, extra=("--metrics-address", f"127.0.0.1:{c.store_metrics_port}"))
        c.w = [c.worker(family.base, c.st.address, name=f"worker{i}") for i in range(2)]
        c.r = c.router([w.address for w in c.w], c.st.address, extra=("--max-prompt-bytes", "4096"))
        c.wait_serving(c.st, *c.w, c.r)
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(cluster, family):
    router = RouterClient(cluster.r.address, generate_timeout_s=T)
    workers = [WorkerClient(w.address, generate_timeout_s=T) for w in cluster.w]
    store = DeltaStoreClient(cluster.st.address)

    async def all_up():
        return all(w.up for w in await router.list_workers())

    async def all_listed():  # the router's first List may have met a store still starting
        return set(family.variants) <= {m.model_id for m in await router.list_models()}

    await wait_for(all_up, what="the router to see both workers up")
    # Tests that stall the store (SIGSTOP) need the router to know the variants already: it
    # reports SERVING before its first successful List (it answers the base without a store).
    await wait_for(all_listed, what="the router to list the family's variants")
    yield router, workers, store
    for c in (router, *workers, store):
        await c.close()


async def run(router: RouterClient, model: str, prompt: str, n: int = N, **kw) -> list[pb.GenerateResponse]:
    """The stream's messages (each holds every token the router had ready when it wrote it)."""
    return [m async for m in router.generate(model, prompt, max_new_tokens=n, **kw)]


def tokens(msgs: list[pb.GenerateResponse]) -> list:
    return [t for m in msgs for t in m.tokens]


async def worker_tokens(w: WorkerClient, model: str, prompt: str, n: int = N) -> list[int]:
    from bitdelta.common.v1 import generation_pb2 as gen_pb

    req = wpb.GenerateRequest(model_id=model, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n))
    return [m.token_id async for m in w.generate(req)]


async def refusal(router: RouterClient, model: str) -> RouterCallError | None:
    """The router's error for a one-token request to `model`, or None if it answered."""
    try:
        await run(router, model, "hi", n=1)
    except RouterCallError as e:
        return e
    return None


async def wait_for(pred, timeout: float = 30, what: str = "condition", every_s: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        r = await pred()
        if r:
            return r
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)


# -- correctness and the first message --------------------------------------------------------------


async def test_same_tokens_as_the_worker_alone(clients):
    router, workers, _ = clients
    for model, prompt in PROMPTS.items():
        msgs = await run(router, model, prompt)
        alone = await worker_tokens(workers[0], model, prompt)
        assert [t.token_id for t in tokens(msgs)] == alone, model
        first, last = msgs[0], tokens(msgs)[-1]
        assert first.worker in {w.target for w in workers}
        t = first.ttft
        assert t.total_ms > 0 and t.prefill_ms > 0 and t.queue_ms >= 0 and t.total_ms >= t.prefill_ms
        assert all(not m.worker for m in msgs[1:]) and not any(m.HasField("ttft") for m in msgs[1:])
        assert last.finish_reason != 0 and last.usage.completion_tokens == len(alone)
        assert not any(t.HasField("usage") for t in tokens(msgs)[:-1])
        assert last.usage.prompt_tokens > 0


async def test_a_retry_asks_the_other_workers_when_its_view_says_none_is_up(clients, cluster):
    """The router's view is up to one poll old: a worker a missed poll marked down may be serving.
    A router in this process (Status polled once, never again) sees a worker that is gone as up and
    the real one as down; the request fails UNAVAILABLE on the gone one before its first token, and
    the retry polls the others at once and completes on the real worker, same tokens."""
    from bitdelta.generation import Request, Sampling
    from services.router.config import RouterConfig
    from services.router.server import build_router

    _, workers, _ = clients
    gone, real = f"127.0.0.1:{free_port()}", cluster.w[0].address  # nothing listens on `gone`
    config = RouterConfig.from_args(
        ["--workers", f"{gone},{real}", "--delta-store", cluster.st.address, "--poll-s", "3600"], env={}
    )
    router = build_router(config)
    try:
        await router.pool.poll_all()
        g, r = router.pool.workers[gone], router.pool.workers[real]
        assert not g.reachable and router.pool.is_up(r)
        g.reachable, g.why_down, g.ready, g.base = True, "", True, r.base  # the stale view: swapped
        router.pool.mark_down(real, "Status failed: DEADLINE_EXCEEDED (a missed poll)")
        request = Request(model_id="", prompt="hello there", sampling=Sampling(max_new_tokens=8))
        got = [ev async for ready in router.generate(request) for ev in ready]
        assert got[0].worker == real
        assert [ev.token_id for ev in got] == await worker_tokens(workers[0], "", "hello there", n=8)
        assert not router.pool.is_up(router.pool.workers[gone]) and router.pool.is_up(router.pool.workers[real])
    finally:
        await router.close()
        await router.registry.store.close()


async def test_concurrent_mixed_variants_match(clients):
    router, workers, _ = clients
    want = {m: await worker_tokens(workers[1], m, p) for m, p in PROMPTS.items()}
    got = await asyncio.gather(*[run(router, m, p) for m, p in PROMPTS.items() for _ in range(3)])
    for (m, _), msgs in zip([(m, p) for m, p in PROMPTS.items() for _ in range(3)], got):
        assert [x.token_id for x in tokens(msgs)] == want[m], m


async def test_list_models_and_workers(clients, family, cluster):
    router, _, _ = clients
    await run(router, "v0", "hi", n=2)
    models = {m.model_id: m for m in await router.list_models()}
    first = (await router.list_models())[0]
    assert first.is_base and first.servable and first.delta_bytes == 0
    for v in family.variants:
        m = models[v]
        assert m.servable and not m.reason and m.delta_bytes == family.delta_path(v).stat().st_size
        assert m.base_fingerprint == first.base_fingerprint
    assert models["v0"].resident_on, "v0 just ran: it is resident somewhere"
    other = models[family.other_base]
    assert not other.servable and "built for base" in other.reason
    ws = await router.list_workers()
    assert [w.address for w in ws] == [w.address for w in cluster.w]
    assert all(w.up and not w.reason and w.device == "cpu" and w.capacity > 0 for w in ws)


async def test_requests_for_one_variant_share_a_worker(clients):
    router, _, _ = clients
    msgs = await asyncio.gather(*[run(router, "v1", "same worker please", n=3) for _ in range(6)])
    assert len({m[0].worker for m in msgs}) == 1, "requests for one variant share its worker while it has room"


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,prompt,kw,code,words",
    [
        ("nope", "hi", {}, grpc.StatusCode.NOT_FOUND, "ListModels"),
        ("v0", "", {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ("v0", "x" * 5000, {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ("v0", "hi", {"temperature": math.nan}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ("v0", "hi", {"temperature": 1e-45}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ("v0", "hi", {"top_p": 2.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ("v0", "hi", {"n": 10**6}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ("../etc/passwd", "hi", {}, grpc.StatusCode.INVALID_ARGUMENT, "model_id"),
        ("m" * 20000, "hi", {}, grpc.StatusCode.INVALID_ARGUMENT, "model_id"),
    ],
)
async def test_bad_requests_get_a_clear_status(clients, model, prompt, kw, code, words):
    router, _, _ = clients
    with pytest.raises(RouterCallError) as e:
        await run(router, model, prompt, **kw)
    assert e.value.code == code and words in e.value.details, e.value.details
    assert len(e.value.details) < 1200  # long values are clipped, not echoed
    assert len(tokens(await run(router, "v0", "still fine", n=2))) >= 1  # the next normal request is served


async def test_token_id_prompts_are_run_as_they_are(clients, family):
    """prompt_token_ids: the router passes them on and the worker runs them as they are (no special
    tokens added), so the text's own ids give its tokens, through the router and at a worker; ids past
    the vocabulary, text and ids at once, ids on a chat template's turn and more ids than the router's
    byte limit are INVALID_ARGUMENT naming prompt_token_ids."""
    from tokenizers import Tokenizer

    from bitdelta.common.v1 import generation_pb2 as gen_pb

    router, workers, _ = clients
    ids = Tokenizer.from_file(str(family.base / "tokenizer.json")).encode(PROMPTS["v0"]).ids
    want = await worker_tokens(workers[0], "v0", PROMPTS["v0"])
    sp = gen_pb.SamplingParams(max_new_tokens=N)
    got = [
        t.token_id
        async for m in router.generate_request(pb.GenerateRequest(model_id="v0", prompt_token_ids=ids, sampling=sp))
        for t in m.tokens
    ]
    assert got == want
    wreq = wpb.GenerateRequest(model_id="v0", prompt_token_ids=ids, sampling=sp)
    assert [m.token_id async for m in workers[0].generate(wreq)] == want
    for bad, words in (
        (dict(prompt_token_ids=[10**6]), "not a token of this model"),
        (dict(prompt="hi", prompt_token_ids=ids), "not both"),
        (dict(prompt_token_ids=ids, templated=True), "chat template"),
        (dict(prompt_token_ids=[1] * 1025), "4 bytes each"),  # the router's --max-prompt-bytes 4096
    ):
        with pytest.raises(RouterCallError) as e:
            [m async for m in router.generate_request(pb.GenerateRequest(model_id="v0", sampling=sp, **bad))]
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value.details
        assert e.value.details.startswith("prompt_token_ids:") and words in e.value.details, e.value.details
    assert len(tokens(await run(router, "v0", "still fine", n=2))) >= 1


async def test_wrong_base_delta_is_refused_and_others_keep_serving(clients, family):
    router, _, _ = clients
    with pytest.raises(RouterCallError) as e:
        await run(router, family.other_base, "hi")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "compress it again" in e.value.details
    assert len(tokens(await run(router, "v2", "hi", n=3))) == 3


# -- the registry follows the store ----------------------------------------------------------------------


async def test_put_makes_a_variant_servable_and_delete_stops_it(clients, family):
    router, workers, store = clients
    await store.put("fresh", family.delta_path("v0"))  # v0's delta under a new name
    msgs = await run(router, "fresh", PROMPTS["v0"])
    assert [t.token_id for t in tokens(msgs)] == await worker_tokens(workers[0], "v0", PROMPTS["v0"])
    await store.put("foreign", family.delta_path(family.other_base))
    with pytest.raises(RouterCallError) as e:
        await run(router, "foreign", "hi")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not {m.model_id: m for m in await router.list_models()}["foreign"].servable
    await store.delete("fresh")
    e = await wait_for(lambda: refusal(router, "fresh"), what="the deleted variant to stop")
    assert e.code == grpc.StatusCode.NOT_FOUND and "deleted" in e.details
    assert len(tokens(await run(router, "v1", "others keep serving", n=2))) == 2


# -- coalescing of a cold variant ---------------------------------------------------------------------------


async def test_fifty_requests_for_a_cold_variant_cause_one_load(clients, cluster):
    """50 concurrent requests for a cold variant: one load on one worker (the store stalled with
    SIGSTOP so the load is still running when all 50 are in), while a resident variant is served."""
    router, workers, _ = clients
    for w in workers:
        await w.evict_delta("v2")
        await w.load_delta("v0")  # resident everywhere: the request for it below causes no load
    before = [(await w.status()).loads_started for w in workers]
    fetches_before = sample(cluster.store_metrics_port, "bitdelta_delta_store_fetches_total", delta="v2")
    cluster.st.popen.send_signal(signal.SIGSTOP)
    try:
        cold = [asyncio.create_task(run(router, "v2", PROMPTS["v2"])) for _ in range(50)]

        async def all_admitted():
            m = {x.model_id: x for x in await router.list_models()}
            return m["v2"].in_flight == 50 and m["v2"].loading_on

        await wait_for(all_admitted, what="50 requests in flight for v2")
        t = time.monotonic()
        warm = await run(router, "v0", PROMPTS["v0"])  # resident: never held behind the load
        assert tokens(warm)[-1].finish_reason != 0 and time.monotonic() - t < 60
        assert not any(c.done() for c in cold), "the cold requests cannot finish while the store is stopped"
    finally:
        cluster.st.popen.send_signal(signal.SIGCONT)
    results = await asyncio.gather(*cold)
    after = [(await w.status()).loads_started for w in workers]
    assert sum(a - b for a, b in zip(after, before)) == 1, (before, after)
    fetches = sample(cluster.store_metrics_port, "bitdelta_delta_store_fetches_total", delta="v2")
    assert fetches - fetches_before == 1, "the store served one Fetch of v2"
    assert len({r[0].worker for r in results}) == 1
    home = next(w for w in workers if w.target == results[0][0].worker)
    want = await worker_tokens(home, "v2", PROMPTS["v2"])
    assert all([t.token_id for t in tokens(r)] == want for r in results)
    arrivals = sorted(r[0].arrival_state for r in results)
    assert arrivals.count(pb.ARRIVAL_STATE_COLD) == 1 and arrivals.count(pb.ARRIVAL_STATE_LOADING) == 49


# -- admission and deadlines -----------------------------------------------------------------------------


async def test_full_queues_and_deadlines(clients, cluster):
    """A second router over the same workers, one request per worker at a time, a queue of 2."""
    _, workers, _ = clients
    r2 = cluster.router(
        [cluster.w[0].address],
        cluster.st.address,
        name="router-small",
        extra=("--max-in-flight-per-worker", "1", "--max-queue", "2", "--max-queue-per-variant", "2"),
    )
    cluster.wait_serving(r2)
    async with RouterClient(r2.address, generate_timeout_s=T) as small:
        await workers[0].evict_delta("v1")
        cluster.st.popen.send_signal(signal.SIGSTOP)  # the load of v1 cannot finish: its request holds the slot
        try:
            hold = asyncio.create_task(run(small, "v1", "hold the worker", n=2))

            async def holding():
                return (await small.list_workers())[0].in_flight == 1

            await wait_for(holding, what="the first request to take the worker's one slot")
            queued = [asyncio.create_task(run(small, "v0", "wait", n=2)) for _ in range(2)]

            async def queue_full():
                return {m.model_id: m for m in await small.list_models()}["v0"].in_flight == 2

            await wait_for(queue_full, what="two requests in the queue")
            with pytest.raises(RouterCallError) as e:
                await run(small, "v0", "one too many", n=2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in e.value.details
            assert not hold.done() and not any(q.done() for q in queued)
        finally:
            cluster.st.popen.send_signal(signal.SIGCONT)
        assert len(await hold) == 2
        assert all(len(q) == 2 for q in await asyncio.gather(*queued))  # the queue drains
    r2.stop()

    # a deadline shorter than the work: DEADLINE_EXCEEDED, and the worker frees the sequence. The
    # tiny model's whole generation takes well under 0.1 s here, so a fixed fraction of one
    # measurement can turn out longer than the next run: each try measures the work again, and a
    # call that did not expire must have finished inside its deadline (anything else is a bug).
    # Seeded sampling, not plain greedy: a step at a time (greedy decode bursts ran the whole
    # generation in a few ms, which the routing alone outlasted)
    async with RouterClient(cluster.r.address) as router:
        prompt = "a long prompt " * 10  # 140 tokens: 116 more fill the context
        seen_running = False

        async def watch():
            nonlocal seen_running
            while True:
                st = await workers[0].status()
                st1 = await workers[1].status()
                seen_running |= st.running + st1.running > 0
                await asyncio.sleep(0.005)

        expired, finished, early = None, [], []
        for _ in range(6):
            t = time.monotonic()
            await run(router, "", prompt, n=116, temperature=0.7, seed=1)
            deadline = 0.4 * (time.monotonic() - t)
            seen_running = False
            watcher = asyncio.create_task(watch())
            t = time.monotonic()
            try:
                await run(router, "", prompt, n=116, temperature=0.7, seed=1, timeout_s=deadline)
            except RouterCallError as e:
                assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED, e
                if seen_running:  # it expired on a worker, which must free it (below)
                    expired = e
                    break
                # on a loaded machine the routing alone can outlast a deadline this short: that
                # call never reached a worker, so it shows nothing about freeing; measure again
                early.append(f"{deadline:.3f} s")
                continue
            finally:
                watcher.cancel()
            took = time.monotonic() - t
            assert took <= deadline + 0.02, f"a call finished after {took:.3f} s, past its {deadline:.3f} s deadline"
            finished.append(f"{took:.3f} s within {deadline:.3f} s")
        assert expired is not None, (
            f"no deadline expired on a worker in six tries: finished {finished}, expired before a worker {early}"
        )

    async def freed():
        sts = [await w.status() for w in workers]
        return all(s.running == 0 and s.waiting == 0 and s.kv_tokens_used == 0 for s in sts)

    await wait_for(freed, what="the worker to free the expired sequence")


async def test_a_client_that_cancels_frees_the_sequence_on_the_worker(clients):
    router, workers, _ = clients
    prompt = "cancel me " * 5
    sampled = {"temperature": 0.7, "seed": 1}  # a step at a time (greedy decode bursts end it in a few ms)
    t = time.monotonic()
    full = await run(router, "v0", prompt, n=200, **sampled)
    full_s = time.monotonic() - t  # what the whole generation takes here
    stream = router.generate("v0", prompt, max_new_tokens=200, **sampled)
    t = time.monotonic()
    first = await anext(stream)
    worker = next(w for w in workers if w.target == first.worker)
    assert (await worker.status()).running == 1
    await stream.aclose()  # leaving the loop cancels the call: router -> worker

    async def freed():
        s = await worker.status()
        return s.running == 0 and s.waiting == 0 and s.kv_tokens_used == 0

    # polled often: the whole generation takes only ~0.1 s on the tiny model, as long as one 0.1 s poll
    await wait_for(freed, what="the worker to free the cancelled sequence", every_s=0.005)
    freed_s = time.monotonic() - t
    assert len(tokens(full)) > 50 and freed_s < full_s, (
        f"freed after {freed_s:.3f} s; the whole generation takes {full_s:.3f} s"
    )
    assert len(tokens(await run(router, "v0", "next", n=2))) == 2


async def test_a_slow_client_gets_the_same_tokens_in_fewer_messages(clients, cluster):
    """The router reads the worker ahead and writes every token it has when the client's window
    lets it: a client with a small receive window that pauses after each message gets fewer
    messages than tokens, with the same tokens, text, logprobs and choices as one that keeps up."""
    from bitdelta.common.v1 import generation_pb2 as gen_pb
    from bitdelta.router.v1 import router_pb2_grpc as pb_grpc

    router, _, _ = clients
    sampling = gen_pb.SamplingParams(max_new_tokens=200, ignore_eos=True, n=2, temperature=0.8, seed=5, logprobs=2)
    # each call its own cache salt: no prefix-cache hit makes one prefill differ from the other in the last bits
    req = pb.GenerateRequest(model_id="v0", prompt="slow " * 4, sampling=sampling, cache_salt="quick")
    quick = [m async for m in router.generate_request(req)]
    req.cache_salt = "slow"
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(cluster.r.address, options=small_window) as ch:
        slow = []
        async for m in pb_grpc.RouterServiceStub(ch).Generate(req, timeout=T):
            slow.append(m)
            await asyncio.sleep(0.02)

    def content(msgs):  # everything a token carries but its time
        return [(t.token_id, t.text, t.index, t.logprobs.SerializeToString(), t.finish_reason) for t in tokens(msgs)]

    assert len(tokens(quick)) == 400 and content(slow) == content(quick)
    assert len(slow) < 400 / 2, f"{len(slow)} messages for 400 tokens: not batched"
    for msgs in (quick, slow):
        assert len(msgs[0].tokens) == 1 and msgs[0].worker and msgs[0].HasField("ttft"), "the first token alone"
        assert sorted(t.usage.completion_tokens for t in tokens(msgs) if t.finish_reason) == [200, 200]
    ms = [t.elapsed_ms for t in tokens(slow)]
    assert ms == sorted(ms), "each token timed at its arrival at the router, in order"


# -- the command line ---------------------------------------------------------------------------------------


async def test_cli_generate_and_models(clients, cluster, family):
    import subprocess
    import sys
    from pathlib import Path

    router, _, _ = clients
    text = "".join(t.text for t in tokens(await run(router, "v0", PROMPTS["v0"])))
    cli = [str(Path(sys.executable).parent / "bitdelta")]  # the installed command
    r = await asyncio.to_thread(
        subprocess.run,
        [*cli, "generate", "--router", cluster.r.address, "--model", "v0", "--max-new-tokens", str(N), PROMPTS["v0"]],
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPTS["v0"] + text + "\n"
    assert "ttft" in r.stderr and "prefill" in r.stderr and f"{N} tokens" in r.stderr
    # vLLM's sampling fields on the command line: what the router gives for the same Sampling
    from bitdelta.generation import Sampling
    from bitdelta.router.v1 import router_pb2 as rpb

    s = Sampling(max_new_tokens=N, repetition_penalty=1.5, top_k=5, temperature=0.8, seed=3)
    req = rpb.GenerateRequest(model_id="v0", prompt=PROMPTS["v0"], sampling=s.to_pb())
    want = "".join(t.text for t in tokens([m async for m in router.generate_request(req)]))
    flags = ["--repetition-penalty", "1.5", "--top-k", "5", "--temperature", "0.8", "--seed", "3"]
    r = await asyncio.to_thread(
        subprocess.run,
        [
            *cli,
            "generate",
            "--router",
            cluster.r.address,
            "--model",
            "v0",
            "--max-new-tokens",
            str(N),
            *flags,
            PROMPTS["v0"],
        ],
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPTS["v0"] + want + "\n" and want != text
    r = await asyncio.to_thread(
        subprocess.run, [*cli, "models", "--router", cluster.r.address], capture_output=True, text=True, timeout=T
    )
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert set(family.variants) <= set(lines) and "NOT SERVABLE" in lines[family.other_base]
    r = await asyncio.to_thread(
        subprocess.run,
        [*cli, "generate", "--router", cluster.r.address, "--model", "nope", "hi"],
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "Traceback" not in r.stderr


async def test_cli_store_put_list_rm(clients, cluster, family):
    """`bitdelta store put` makes a variant servable at once (v0's delta under a new name answers with
    v0's tokens), `list` shows it, a second put without --overwrite is ALREADY_EXISTS, `rm` stops it."""
    import subprocess
    import sys
    from pathlib import Path

    router, workers, _ = clients
    cli = [str(Path(sys.executable).parent / "bitdelta"), "store"]

    async def bitdelta(*args):
        return await asyncio.to_thread(
            subprocess.run, [*cli, *args, "--store", cluster.st.address], capture_output=True, text=True, timeout=T
        )

    r = await bitdelta("put", str(family.delta_path("v0")), "--name", "from-cli")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("stored from-cli:") and "put from-cli" in r.stderr  # the progress bar
    msgs = await run(router, "from-cli", PROMPTS["v0"])
    assert [t.token_id for t in tokens(msgs)] == await worker_tokens(workers[0], "v0", PROMPTS["v0"])
    r = await bitdelta("list")
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert r.returncode == 0 and "from-cli" in rows and set(family.variants) <= set(rows), r.stdout
    r = await bitdelta("put", str(family.delta_path("v1")), "--name", "from-cli")
    assert r.returncode == 1 and "ALREADY_EXISTS" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = await bitdelta("rm", "from-cli")
    assert r.returncode == 0 and r.stdout.strip() == "deleted from-cli", r.stderr
    e = await wait_for(lambda: refusal(router, "from-cli"), what="the deleted variant to stop")
    assert e.code == grpc.StatusCode.NOT_FOUND
    r = await bitdelta("rm", "from-cli")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr, r.stderr


async def test_grpcurl_through_reflection(clients, cluster):
    """The README's grpcurl line works: reflection describes the API, Generate streams JSON."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    router, _, _ = clients
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"
    body = json.dumps({"model_id": "v0", "prompt": PROMPTS["v0"], "sampling": {"max_new_tokens": N}})
    r = await asyncio.to_thread(
        subprocess.run,
        [grpcurl, "-plaintext", "-d", body, cluster.r.address, "bitdelta.router.v1.RouterService/Generate"],
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert r.returncode == 0, r.stderr
    msgs = [json.loads(m) for m in r.stdout.replace("}\n{", "}\x00{").split("\x00")]
    want = [t.token_id for t in tokens(await run(router, "v0", PROMPTS["v0"]))]
    assert (
        [t.get("token_id", 0) for m in msgs for t in m["tokens"]] == want
        and msgs[0]["worker"]
        and msgs[0]["ttft"]["total_ms"] > 0
    )
