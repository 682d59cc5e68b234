"""Hostile input against the running system (issue #12): property-based requests to every rpc of
the router, the workers and the store, and fuzzed or truncated delta files.

The property for every request: a proper status — never INTERNAL or UNKNOWN, never a hang past the
call's deadline (DEADLINE_EXCEEDED here means a hang: nothing asked is slow), errors short (long
values are clipped, not echoed) — and afterwards every service still answers a normal request
correctly (the same greedy tokens as before). For every damaged delta file: it never loads
(DATA_LOSS / INVALID_ARGUMENT / FAILED_PRECONDITION, or Put refused) and no worker goes down; a
damage that leaves every tensor byte intact (JSON whitespace, or a free-text metadata value such as
`tool_version`, which no checksum covers) may load, and then serves exactly the original's tokens.

Hypothesis runs a bounded number of examples with no per-example deadline, so a busy machine
passes; the calls' own deadlines catch hangs. Sync gRPC stubs (hypothesis drives sync functions).
"""

from __future__ import annotations

import math
import os
import struct

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.delta_store.v1 import delta_store_pb2 as spb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as spb_grpc
from bitdelta.format import read_header
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as wpb_grpc
from bitdelta.router.v1 import router_pb2 as rpb
from bitdelta.router.v1 import router_pb2_grpc as rpb_grpc
from tests.support.reliability import BAD, PROMPTS, TALLY, TOKENS, T, call_ok_or_status, check_answer, router_tokens

SETTINGS = settings(
    max_examples=int(os.environ.get("BITDELTA_FUZZ_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
    derandomize=False,
)

# -- strategies: the values a hostile client sends ---------------------------------------------------------

TRICK_NAMES = [
    "",
    ".",
    "..",
    "../etc/passwd",
    "v0/../v1",
    "/etc/passwd",
    ".hidden",
    "v0\x00",
    "a\x00b",
    "v0\n",
    "v0 ",
    " v0",
    "~root",
    "%2e%2e%2fetc",
    "v0.safetensors",
    "v0.bitdelta.safetensors",
    "CON",
    "NUL",
    "ü",
    "模型",
    "\u202ev0",
    "a" * 128,
    "a" * 129,
    "m" * 20000,
    "v0/",
    "\\..\\x",
    "-v0",
    "_v0",
    "v0..",
    ".partial",
    "v0\r\n\r\nX-Injected: 1",
    "\ud7ff",
    "\U0010ffff",
]
names = st.one_of(
    st.sampled_from(TRICK_NAMES),
    st.text(max_size=40),
    st.text(min_size=129, max_size=400),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
)
floats = st.one_of(
    st.floats(width=32),
    st.sampled_from(
        [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1e-3, 3.4e38, -1.0, 1.0, 100.0, 100.1]
    ),
)
u32 = st.one_of(st.integers(0, 12), st.sampled_from([2**32 - 1, 2**31, 4096, 4097, 257, 10**6]))
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1]))


def big(n: int, ch: str = "x") -> str:
    return ch * n


prompts = st.one_of(
    st.sampled_from(["", "\x00", "\x00" * 100, "a\x00b", "\ufeff", "🙂" * 50, "\r\n" * 100]),
    st.text(max_size=200),
    st.sampled_from([70_000, 1 << 20, (1 << 20) + 1, 3 << 20]).map(big),
    st.sampled_from([2000, 20_000]).map(lambda n: big(n, "ab ")),
)
stops = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(["", "\x00", "x" * 300])), max_size=20)
sampling = st.builds(gen_pb.SamplingParams, max_new_tokens=u32, temperature=floats, top_p=floats, stop=stops, seed=u64)


# -- the router --------------------------------------------------------------------------------------------


@SETTINGS
@given(model=names, prompt=prompts, sampling=sampling, request_id=st.one_of(st.text(max_size=20), st.just("r" * 5000)))
def test_router_generate_hostile(system, expected, model, prompt, sampling, request_id):
    stub = rpb_grpc.RouterServiceStub(_channel(system.r.address))
    req = rpb.GenerateRequest(model_id=model, prompt=prompt, sampling=sampling, request_id=request_id)
    call_ok_or_status(lambda: list(stub.Generate(req, timeout=T)), "router Generate")


@SETTINGS
@given(
    model=st.sampled_from(["", "v0", "v1", "v2", "v3", "v4", "v5"]), prompt=st.sampled_from(PROMPTS), sampling=sampling
)
def test_router_generate_valid_models_hostile_sampling(system, expected, model, prompt, sampling):
    """Known models, hostile sampling: accepted ones stream, others are refused naming the field."""
    stub = rpb_grpc.RouterServiceStub(_channel(system.r.address))
    req = rpb.GenerateRequest(model_id=model, prompt=prompt, sampling=sampling)
    call_ok_or_status(lambda: list(stub.Generate(req, timeout=T)), "router Generate")


def test_router_list_rpcs_and_health(system):
    stub = rpb_grpc.RouterServiceStub(_channel(system.r.address))
    assert stub.ListModels(rpb.ListModelsRequest(), timeout=T).models
    assert stub.ListWorkers(rpb.ListWorkersRequest(), timeout=T).workers
    _health_ok(system.r.address)


# -- the workers -------------------------------------------------------------------------------------------


@SETTINGS
@given(model=names, prompt=prompts, sampling=sampling)
def test_worker_generate_hostile(system, expected, model, prompt, sampling):
    stub = wpb_grpc.GpuWorkerServiceStub(_channel(system.w[0].address))
    req = wpb.GenerateRequest(model_id=model, prompt=prompt, sampling=sampling)
    call_ok_or_status(lambda: list(stub.Generate(req, timeout=T)), "worker Generate")


@SETTINGS
@given(name=names, pin=st.booleans(), evict=st.booleans())
def test_worker_load_evict_hostile(system, expected, name, pin, evict):
    stub = wpb_grpc.GpuWorkerServiceStub(_channel(system.w[1].address))
    call_ok_or_status(lambda: stub.LoadDelta(wpb.LoadDeltaRequest(name=name, pin=pin), timeout=T), "LoadDelta")
    if evict or pin:  # never leave a pin behind: the next examples need the budget
        call_ok_or_status(lambda: stub.EvictDelta(wpb.EvictDeltaRequest(name=name), timeout=T), "EvictDelta")
    st_ = stub.Status(wpb.StatusRequest(), timeout=T)
    assert st_.delta_used_bytes <= st_.delta_budget_bytes
    assert len(st_.slots) <= 64, "Status entries must stay bounded"


# -- the store ---------------------------------------------------------------------------------------------


@SETTINGS
@given(name=names, chunk=u32, fp=st.one_of(st.just(""), st.text(max_size=80), st.just("f" * 64)))
def test_store_stat_fetch_delete_hostile(system, name, chunk, fp):
    stub = spb_grpc.DeltaStoreServiceStub(_channel(system.st.address))
    call_ok_or_status(lambda: stub.Stat(spb.StatRequest(name=name), timeout=T), "Stat")
    call_ok_or_status(
        lambda: list(stub.Fetch(spb.FetchRequest(name=name, chunk_bytes=chunk, expect_base_fingerprint=fp), timeout=T)),
        "Fetch",
    )
    if name not in {f"v{i}" for i in range(6)} | {"otherbase"}:  # the family stays
        call_ok_or_status(lambda: stub.Delete(spb.DeleteRequest(name=name), timeout=T), "Delete")


@SETTINGS
@given(
    name=names,
    size=u64,
    overwrite=st.booleans(),
    pieces=st.lists(
        st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00" * 8, struct.pack("<Q", 2**63)])), max_size=5
    ),
    no_header=st.booleans(),
)
def test_store_put_hostile(system, name, size, overwrite, pieces, no_header):
    stub = spb_grpc.DeltaStoreServiceStub(_channel(system.st.address))
    assume(name not in {f"v{i}" for i in range(6)} | {"otherbase"})

    def requests():
        if not no_header:
            yield spb.PutRequest(header=spb.PutHeader(name=name, size_bytes=size, overwrite=overwrite))
        for p in pieces:
            yield spb.PutRequest(data=p)

    ok = call_ok_or_status(lambda: stub.Put(requests(), timeout=T), "Put")
    assert not ok, "random bytes are never a valid delta"
    listed = {d.name for d in stub.List(spb.ListRequest(), timeout=T).deltas}
    assert name not in listed or name in {f"v{i}" for i in range(6)}


# -- damaged delta files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def original(family):
    return family.delta_path("v0").read_bytes()


def _damage(data: bytes, kind: str, where: int, mask: int) -> bytes:
    b = bytearray(data)
    if kind == "flip":
        b[where % len(b)] ^= mask or 1
        return bytes(b)
    if kind == "truncate":
        return bytes(b[: where % len(b)])
    if kind == "append":
        return bytes(b) + bytes([mask])
    if kind == "header_len":  # a lying header length
        return struct.pack("<Q", [0, 7, 2**63, len(b), where][mask % 5]) + bytes(b[8:])
    raise AssertionError(kind)


def _region(original: bytes, pos: int) -> str:
    hlen = struct.unpack("<Q", original[:8])[0]
    return "length" if pos < 8 else "header" if pos < 8 + hlen else "tensor bytes"


damage = st.tuples(
    st.sampled_from(["flip", "flip", "flip", "truncate", "append", "header_len"]),
    st.integers(0, 2**31),
    st.integers(0, 255),
)
_accepted: list[str] = []


@SETTINGS
@given(d=damage, in_header=st.booleans())
def test_damaged_delta_never_loads(system, family, expected, original, d, in_header):
    """A damaged v0 dropped into the store's directory (bit rot, a bad copy): the worker's load fails
    with a data status, or (damage outside every checksummed byte) serves v0's own tokens."""
    kind, where, mask = d
    if in_header:  # half the flips land in the 8-byte length + JSON header, the other half anywhere
        where %= 8 + struct.unpack("<Q", original[:8])[0]
    data = _damage(original, kind, where, mask)
    assume(data != original)
    name = f"fz-{abs(hash((kind, where, mask))) % 10**9}"
    path = system.root / f"{name}.bitdelta.safetensors"
    path.write_bytes(data)
    TALLY.fault("damaged delta file")
    stub = wpb_grpc.GpuWorkerServiceStub(_channel(system.w[0].address))
    try:
        ok = call_ok_or_status(
            lambda: stub.LoadDelta(wpb.LoadDeltaRequest(name=name), timeout=T), "LoadDelta", allowed=BAD
        )
        if ok:  # loaded: only possible if no tensor byte and nothing checked changed
            _accepted.append(f"{kind}@{_region(original, where % len(original))}")
            TALLY.notes.append(
                f"damaged delta accepted (weights intact): {kind} in the {_region(original, where % len(original))}"
            )
            toks = [
                t.token_id
                for m in stub.Generate(
                    wpb.GenerateRequest(
                        model_id=name, prompt=PROMPTS[0], sampling=gen_pb.SamplingParams(max_new_tokens=TOKENS)
                    ),
                    timeout=T,
                )
                for t in m.tokens
            ]
            check_answer(expected, "v0", PROMPTS[0], toks)
            assert kind == "flip" and _region(original, where % len(original)) == "header"
    finally:
        path.unlink()
        call_ok_or_status(lambda: stub.EvictDelta(wpb.EvictDeltaRequest(name=name), timeout=T), "EvictDelta")
    assert system.w[0].alive()


@SETTINGS
@given(d=damage)
def test_damaged_delta_put_is_refused(system, original, d):
    kind, where, mask = d
    data = _damage(original, kind, where, mask)
    assume(data != original)
    stub = spb_grpc.DeltaStoreServiceStub(_channel(system.st.address))

    def requests():
        yield spb.PutRequest(header=spb.PutHeader(name="fz-put", size_bytes=len(data), overwrite=True))
        for i in range(0, len(data), 16384):
            yield spb.PutRequest(data=data[i : i + 16384])

    TALLY.fault("damaged Put")
    ok = call_ok_or_status(lambda: stub.Put(requests(), timeout=T), "Put", allowed=BAD)
    if ok:  # whitespace / free-text metadata only: every tensor byte and checked field is the original's
        assert kind == "flip" and _region(original, where % len(original)) == "header"
        got, want = read_header_bytes(data), read_header_bytes(original)
        assert [(t.name, t.dtype, t.shape, t.start) for t in got.tensors] == [
            (t.name, t.dtype, t.shape, t.start) for t in want.tensors
        ] and got.sha256 == want.sha256
        stub.Delete(spb.DeleteRequest(name="fz-put"), timeout=T)
    else:
        assert "fz-put" not in {x.name for x in stub.List(spb.ListRequest(), timeout=T).deltas}


def read_header_bytes(data: bytes):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        return read_header(f.name)


def test_after_the_hostile_traffic_everything_still_answers_correctly(system, family, expected):
    for model in ["", *family.variants]:
        for prompt in PROMPTS[:1]:
            check_answer(expected, model, prompt, router_tokens(system.r.address, model, prompt))
    for p in (system.st, *system.w, system.r):
        assert p.alive(), f"{p.name} died"
        _health_ok(p.address)


# -- helpers -----------------------------------------------------------------------------------------------

_channels: dict[str, grpc.Channel] = {}


def _channel(address: str) -> grpc.Channel:
    if address not in _channels:
        _channels[address] = grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        )
    return _channels[address]


def _health_ok(address: str) -> None:
    stub = health_pb2_grpc.HealthStub(_channel(address))
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=T).status == health_pb2.HealthCheckResponse.SERVING
