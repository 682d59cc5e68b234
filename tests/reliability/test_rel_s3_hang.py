"""A hanging S3 server (issue #12): the delta store runs with `--backend s3` against a real
OpenStack Swift, and Swift's own processes (proxy, object, container and account server) are
stopped with SIGSTOP: they accept connections and answer nothing, as a hung S3 endpoint does.

What must hold, with real processes throughout (a private Swift on its own ports and directory,
started by scripts/swift.sh; the store, two workers and the router as in bitdelta/testing/cluster.py):

    a cold variant        (resident on no worker; the store runs with --cache-bytes 0, so it has no
                          copy of its own to fall back to) gets UNAVAILABLE, within a bound set by
                          the store's --backend-timeout-s: never a hang, INTERNAL or UNKNOWN
    resident variants     and the base keep being answered, with the same greedy tokens as before
    ListModels            answers (from the router's memory)
    a Put                 during the hang fails with UNAVAILABLE and leaves nothing visible
    after SIGCONT         the cold variant is served correctly and the Put succeeds, without
                          restarting the store, the workers or the router
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from bitdelta.rpc.clients.delta_store import DeltaStoreClient, StoreUnavailable
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from services.delta_store.backends import SUFFIX
from tests.support.reliability import NEVER, PROMPTS, TALLY, T, routed_tokens, serving, start_system, wait_for
from tests.support.swift import Swift, _run, start_swift

pytestmark = pytest.mark.asyncio(loop_scope="module")
P = PROMPTS[0]
BACKEND_TIMEOUT_S = 2.0  # the store's --backend-timeout-s: one S3 request's connect/read timeout
# How long a cold request may take to fail while S3 hangs. Each S3 call of the store is tried 3
# times (boto3's retries={"max_attempts": 2} are 2 retries after the first try; measured: 3 x 2 s
# = 6 s per store call), and the router retries an UNAVAILABLE load once on the other worker:
# about 12 s. The bound leaves room for a busy 2-core machine and stays well under the client's
# own deadline (T), so a hang shows up as DEADLINE_EXCEEDED and fails the test.
STATUS_BOUND_S = 35.0
assert STATUS_BOUND_S < T - 10


@dataclass
class PrivateSwift:
    """A Swift started for this module only: stopping it disturbs no other test."""

    swift: Swift
    dir: Path
    pids: list[int]  # the servers' processes (scripts/swift.sh writes one pid file per server)

    def _all(self) -> list[int]:
        kids = []
        for pid in self.pids:  # workers = 0: normally no children, but stop any the servers forked
            r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
            kids += [int(x) for x in r.stdout.split()]
        return [*self.pids, *kids]

    def signal(self, sig: int) -> None:
        for pid in self._all():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def states(self) -> set[str]:
        """The servers' process states ('T' = stopped), from /proc/<pid>/stat."""
        return {Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in self.pids}


@pytest.fixture(scope="module")
def private_swift(tmp_path_factory):
    _run(["install"])
    d = tmp_path_factory.mktemp("swift-hang")
    sw = start_swift(d)
    try:
        pids = [int(f.read_text()) for f in sorted((d / "run").glob("*.pid"))]
        assert len(pids) == 4, pids
        yield PrivateSwift(sw, d, pids)
    finally:
        # never leave it stopped: SIGCONT first, whatever happened (a stopped process would also
        # hold up scripts/swift.sh stop until its SIGKILL)
        for pid in [int(f.read_text()) for f in (d / "run").glob("*.pid")]:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        _run(["stop", str(d)], timeout=60)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def s3sys(family, private_swift, tmp_path_factory):
    """The deltas uploaded to a bucket of the private Swift, and a store (S3 backend, no host cache),
    two workers and a router on top."""
    sw = private_swift.swift
    bucket = sw.new_bucket()
    s3 = sw.client()
    for name in family.variants:
        s3.put_object(Bucket=bucket, Key=name + SUFFIX, Body=family.delta_path(name).read_bytes())
    store_args = (
        "--backend",
        "s3",
        "--s3-endpoint",
        sw.endpoint,
        "--s3-bucket",
        bucket,
        "--s3-region",
        sw.region,
        "--backend-timeout-s",
        str(BACKEND_TIMEOUT_S),
        "--cache-bytes",
        "0",
    )
    env = {"AWS_ACCESS_KEY_ID": sw.access_key, "AWS_SECRET_ACCESS_KEY": sw.secret_key}
    c = start_system(family, tmp_path_factory.mktemp("rel_s3_hang"), "s3-hang", store_args=store_args, env=env)
    c.bucket, c.s3 = bucket, s3
    with serving(c):
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(s3sys):
    r = RouterClient(s3sys.r.address, generate_timeout_s=T)
    ws = [WorkerClient(w.address, generate_timeout_s=T) for w in s3sys.w]
    st = DeltaStoreClient(s3sys.st.address, timeout_s=T, fetch_timeout_s=T)
    yield r, ws, st
    for c in (r, *ws, st):
        await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ref(clients, family) -> dict[str, list[int]]:
    """Greedy tokens for P, computed alone while S3 answers (each variant read from Swift)."""
    r, _, _ = clients
    # The router may have started before the store listened (the S3 store starts slower than the
    # local one): its first List failed and it lists again by itself. Ready once it knows the variants.
    await wait_for(
        lambda: _lists(r, family.variants), timeout=120, interval=0.2, what="the router to list the variants in S3"
    )
    out = {m: await routed_tokens(r, m) for m in ("", "v1", "v2")}
    TALLY.answered += len(out)
    assert len({tuple(v) for v in out.values()}) == 3, "the base and the variants must differ"
    return out


async def _lists(r: RouterClient, names) -> bool:
    try:
        return {m.model_id for m in await r.list_models(timeout_s=10)} >= set(names)
    except RouterCallError:
        return False


async def _served(r, ref, model) -> bool:
    try:
        return await routed_tokens(r, model) == ref[model]
    except RouterCallError:
        return False


async def _resident(ws, name) -> list[int]:
    return [i for i, w in enumerate(ws) if name in {s.name for s in (await w.status()).slots}]


async def test_a_hanging_s3_server_gives_unavailable_and_resident_variants_keep_serving(
    s3sys, private_swift, clients, ref, family
):
    r, ws, st = clients
    procs = [s3sys.st, *s3sys.w, s3sys.r]
    pids = [p.popen.pid for p in procs]
    await wait_for(lambda: _all_up(r), what="both workers up")
    for w in ws:  # a known state: nothing resident, so no load below has to evict anything
        for name in family.variants:
            await w.evict_delta(name)
    assert await routed_tokens(r, "v1") == ref["v1"]  # v1 resident on one worker, read from S3 now
    TALLY.correct += 1
    assert len(await _resident(ws, "v1")) == 1 and await _resident(ws, "v2") == []

    private_swift.signal(signal.SIGSTOP)
    TALLY.fault("S3 server hangs (Swift SIGSTOP)")
    try:
        await wait_for(
            lambda: private_swift.states() == {"T"},
            timeout=10,
            interval=0.02,
            what="Swift's processes stopped (else the test would test nothing)",
        )

        # the cold variant: a clear status, within the bound, from the store's backend timeout
        t = time.monotonic()
        with pytest.raises(RouterCallError) as e:
            await routed_tokens(r, "v2")
        took = time.monotonic() - t
        assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value  # not DEADLINE_EXCEEDED (a hang), INTERNAL..
        assert took < STATUS_BOUND_S, f"the cold request took {took:.1f} s to fail"
        assert took > BACKEND_TIMEOUT_S, f"failed in {took:.1f} s: not from the backend's timeout"
        assert "timeout" in str(e.value).lower(), e.value  # the store's reason reaches the client
        TALLY.notes.append(
            f"S3 hang: a cold variant got {e.value.code.name} after {took:.1f} s "
            f"(--backend-timeout-s {BACKEND_TIMEOUT_S:g})"
        )

        # the resident variant and the base are not held behind S3
        for m in ("v1", "", "v1"):
            t = time.monotonic()
            assert await routed_tokens(r, m) == ref[m], f"{m!r} mis-answered while S3 hangs"
            TALLY.correct += 1
            assert time.monotonic() - t < STATUS_BOUND_S
        assert {m.model_id for m in await r.list_models(timeout_s=10)} >= {"v1", "v2"}

        # the store itself: a clear status for calls that need S3 (List, Stat, Put), not a hang
        for what, call in (
            ("List", lambda: st.list()),
            ("Stat", lambda: st.stat("v2")),
            ("Put", lambda: st.put("late", family.delta_path("v0"))),
        ):
            TALLY.sent += 1
            t = time.monotonic()
            with pytest.raises(StoreUnavailable) as e:
                await call()
            TALLY.reject(e.value.code)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.code not in NEVER, (what, e.value)
            assert time.monotonic() - t < STATUS_BOUND_S, f"store {what} took {time.monotonic() - t:.1f} s"
        assert private_swift.states() == {"T"}, "Swift resumed during the test: the asserts above proved little"
    finally:
        private_swift.signal(signal.SIGCONT)

    # back by itself: the cold variant is read from S3 and served right, with no restart
    await wait_for(lambda: _served(r, ref, "v2"), timeout=120, interval=0.5, what="v2 served once S3 answers again")
    TALLY.correct += 1
    # the Put that failed left nothing behind (no object, no multipart upload), and succeeds now
    assert "late" not in {d.name for d in await st.list()}
    assert not s3sys.s3.list_multipart_uploads(Bucket=s3sys.bucket).get("Uploads")
    keys = {o["Key"] for o in s3sys.s3.list_objects_v2(Bucket=s3sys.bucket).get("Contents", [])}
    assert keys == {n + SUFFIX for n in family.variants}, keys
    info = await st.put("late", family.delta_path("v0"))
    assert info.size_bytes == family.delta_path("v0").stat().st_size
    assert (
        s3sys.s3.get_object(Bucket=s3sys.bucket, Key="late" + SUFFIX)["Body"].read()
        == family.delta_path("v0").read_bytes()
    )
    assert await routed_tokens(r, "v1") == ref["v1"]
    TALLY.correct += 1
    assert [p.popen.pid for p in procs] == pids and all(p.alive() for p in procs), "something was restarted"
    TALLY.recovered("S3 server resumed: loads and Puts work again, nothing restarted")


async def _all_up(r: RouterClient) -> bool:
    return all(w.up for w in await r.list_workers())
