"""Shared parts of the reliability suite (see conftest.py): the tally, a cluster that records
peak RSS, the system's start, checked calls."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bitdelta.testing.cluster import Cluster, Proc

N_VARIANTS = 6
TOKENS = 8  # new tokens of every checked greedy answer
PROMPTS = ("Hello world", "abc xyz", "def f(x):")
# Device bytes of one tiny delta (slot + its embedding/head signs) are ~84 KB: this budget holds
# two of the six variants per worker, so a mixed workload evicts all the time.
DELTA_BUDGET = "200KiB"
T = 60  # deadline (s) of every call the suite makes: a hang fails as DEADLINE_EXCEEDED, never stalls


def vm_hwm_kib(pid: int) -> int | None:
    """Peak resident set size of a live process (VmHWM in /proc/<pid>/status), KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def vm_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class Tally:
    sent: int = 0
    correct: int = 0  # answered, and the tokens checked against the expected ones
    answered: int = 0  # answered without a token check (sampled, or hostile but accepted)
    rejected: Counter = field(default_factory=Counter)  # status code name -> count
    faults: Counter = field(default_factory=Counter)  # fault kind -> count
    recoveries: Counter = field(default_factory=Counter)
    peak_rss_kib: dict[str, int] = field(default_factory=dict)  # process label -> max VmHWM seen
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reject(self, code: grpc.StatusCode) -> None:
        with self.lock:
            self.rejected[code.name] += 1

    def fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1

    def recovered(self, kind: str) -> None:
        with self.lock:
            self.recoveries[kind] += 1

    def rss(self, label: str, pid: int) -> None:
        k = vm_hwm_kib(pid)
        if k is not None:
            with self.lock:
                self.peak_rss_kib[label] = max(k, self.peak_rss_kib.get(label, 0))


TALLY = Tally()


async def routed_tokens(r, model: str, prompt: str = PROMPTS[0], n: int = TOKENS, **kw) -> list[int]:
    """The token ids of one Generate through router client `r`, counted in TALLY (sent, rejected)."""
    from bitdelta.rpc.clients.router import RouterCallError

    TALLY.sent += 1
    try:
        return [t.token_id async for m in r.generate(model, prompt, max_new_tokens=n, **kw) for t in m.tokens]
    except RouterCallError as e:
        TALLY.reject(e.code)
        raise


class RelCluster(Cluster):
    """A Cluster that records each process's peak RSS before it stops or is killed."""

    def __init__(self, workdir: Path, label: str, env: dict[str, str] | None = None):
        super().__init__(workdir, env)
        self.label = label

    def record_rss(self, p: Proc) -> None:
        if p.alive():
            TALLY.rss(f"{self.label}/{p.name}", p.popen.pid)

    def kill9(self, p: Proc, kind: str) -> None:
        self.record_rss(p)
        TALLY.fault(kind)
        p.kill9()

    def restart(self, p: Proc) -> Proc:
        self.record_rss(p)
        return super().restart(p)

    def stop_all(self) -> None:
        for p in self.procs:
            self.record_rss(p)
        super().stop_all()


def start_system(
    family,
    work: Path,
    label: str,
    router_extra: tuple[str, ...] = (),
    n_workers: int = 2,
    store_args: tuple[str, ...] | None = None,
    env: dict[str, str] | None = None,
    shared_memory: bool = False,
) -> RelCluster:
    """Store, workers and router. The store serves a copy of the family's deltas from a local
    directory (`c.root`), or, with `store_args` (e.g. `--backend s3 ...`), runs with those flags
    instead (`c.root` is None; the deltas must already be where they point). `shared_memory`: the
    store keeps its host cache in files under `c.shm` and the workers copy deltas out of them."""
    c = RelCluster(work, label, env)
    c.shm = work / "shm" if shared_memory else None
    if store_args is None:
        root = work / "deltas"
        shutil.copytree(family.deltas, root)
        os.remove(root / family.delta_path(family.corrupt).name)  # tests drop in their own corrupt files
        c.root = root
        c.st = c.store(root, extra=("--shared-memory-dir", str(c.shm)) if shared_memory else ())
    else:
        c.root = None
        c.st = c.start("store", "services.delta_store", [*store_args, "--grace-s", "5"])
    # a drain's grace long enough for the streams it lets finish on a loaded machine (a SIGTERM with
    # nothing running ends at once)
    grace = ("--grace-s", "30")
    c.w = [
        c.worker(family.base, c.st.address, name=f"worker{i}", delta_budget=DELTA_BUDGET, extra=grace)
        for i in range(n_workers)
    ]
    c.r = c.router([w.address for w in c.w], c.st.address, extra=("--call-timeout-s", "3", *router_extra))
    try:
        c.wait_serving(c.st, *c.w, c.r)
    except BaseException:
        c.stop_all()
        raise
    return c


@contextlib.contextmanager
def serving(c: RelCluster):
    """`c` once its router sees all its workers up; every process stopped on exit."""
    try:
        _wait_router_sees_workers(c.r.address, len(c.w))
        yield c
    finally:
        c.stop_all()


def _wait_router_sees_workers(address: str, n: int, timeout: float = 120) -> None:
    from bitdelta.router.v1 import router_pb2 as pb
    from bitdelta.router.v1 import router_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.RouterServiceStub(ch)
        while True:
            ws = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
            # and it reaches the store: its registry lists the variants (a router that tried the store
            # before it listened waits out gRPC's reconnect backoff, and would answer UNAVAILABLE)
            try:
                models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
            except grpc.RpcError:
                models = []
            if len(ws) == n and all(w.up for w in ws) and sum(not m.is_base for m in models) > 0:
                return
            assert time.monotonic() < deadline, f"the router did not see {n} workers up: {ws}"
            time.sleep(0.2)


def router_tokens(
    address: str, model: str, prompt: str, n: int = TOKENS, timeout: float = T, count: bool = True
) -> list[int]:
    """Greedy tokens through a router (sync client: usable from hypothesis tests)."""
    from bitdelta.common.v1 import generation_pb2 as gen_pb
    from bitdelta.router.v1 import router_pb2 as pb
    from bitdelta.router.v1 import router_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.RouterServiceStub(ch)
        req = pb.GenerateRequest(model_id=model, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n))
        if count:
            TALLY.sent += 1
        return [t.token_id for m in stub.Generate(req, timeout=timeout) for t in m.tokens]


def check_answer(expected, model: str, prompt: str, tokens: list[int]) -> None:
    assert tokens == expected[(model, prompt)], f"{model!r} {prompt!r} mis-answered"
    TALLY.correct += 1


async def wait_for(pred, timeout: float = 60, what: str = "condition", interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        r = pred()
        if inspect.isawaitable(r):
            r = await r
        if r:
            return r
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(interval)


# Codes a damaged delta may get (a data status; NOT_FOUND where the header is so broken that the
# store does not list or describe it — the name then does not exist as a delta).
BAD = {grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
MAX_DETAILS = 1200  # a status message never echoes a long value whole


def call_ok_or_status(fn, what: str, allowed: set[grpc.StatusCode] | None = None) -> bool:
    """Run one call: True if it succeeded; False if it failed with a proper status (never INTERNAL,
    UNKNOWN or a hang; within `allowed` if given; a short message)."""
    TALLY.sent += 1
    try:
        fn()
    except grpc.RpcError as e:
        code = e.code()
        TALLY.reject(code)
        assert code not in NEVER, f"{what}: {code.name}: {e.details()[:500]}"
        assert allowed is None or code in allowed, f"{what}: {code.name}: {e.details()[:500]}"
        assert len(e.details() or "") < MAX_DETAILS, f"{what}: {len(e.details())}-character message"
        return False
    TALLY.answered += 1
    return True
