"""The shared RPC layer on its own: the server skeleton (status table, clipping, health, drain),
typed config -> flags + env, and status codes kept across hops. A real gRPC server on a loopback
port serves a small generic service defined here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.rpc import client_stream
from bitdelta.rpc.client_stream import ClientStream, call_with_handshake
from bitdelta.rpc.config import ConfigError, ServiceConfig, check_address, parse_list, setting
from bitdelta.rpc.errors import RpcError, ServiceError, clip, status_of, without_addresses
from bitdelta.rpc.serve import Service, create_server, run_until_signal
from bitdelta.units import parse_bytes

SERVICE = "test.v1.Echo"
LEAKY = (
    "delta 'v0' could not be loaded: delta store 10.0.0.7:50051 Fetch('v0'): UNAVAILABLE: failed to connect "
    "to all addresses; last error: UNKNOWN: ipv4:10.0.0.7:50051: Connection refused (store-0.store.prod.svc:50051, "
    "dns:///store:50051, [fd00::7]:50051, unix:/run/store.sock, https://s3.internal:8443/deltas)"
)


class Missing(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


def _echo_service(release: asyncio.Event) -> Service:
    async def unary(request: bytes, context):
        text = request.decode()
        if text == "missing":
            raise Missing("no such thing")
        if text == "downstream":
            raise RpcError("store said no", grpc.StatusCode.INVALID_ARGUMENT)
        if text == "long":
            raise Missing("x" * 50_000)
        if text == "lookup":  # outside the ServiceError family: the status table's
            raise KeyError("no such key")
        if text == "bug":
            raise ZeroDivisionError("oops")
        if text == "leaky":  # a downstream failure as the project's clients word it
            err = RpcError(LEAKY, grpc.StatusCode.UNAVAILABLE)
            err.trailers = {"bitdelta-where": "worker 10.1.2.3:50061"}
            raise err
        if text == "odd trailer":  # e.g. a tensor name read from a corrupted header
            err = Missing("bad tensor")
            err.trailers = {"bitdelta-tensor": "layers.0\x00\xdd<\x86" + "y" * 1000}
            raise err
        return request

    async def stream(request: bytes, context):
        yield b"first"
        await release.wait()
        yield b"second"

    async def upload(requests: ClientStream, context):
        """Header b"ok", b"missing" (refused at the header) or b"later" (refused after 3 messages)."""
        header = await requests.first()
        if header == b"missing":
            raise Missing("no such upload")
        await requests.accept()
        n = 0
        async for m in requests:
            n += len(m)
            if header == b"later" and n >= 3 << 20:
                raise Missing("refused part-way")
        return str(n).encode()

    ident = dict(request_deserializer=None, response_serializer=None)
    handlers = {
        "Say": grpc.unary_unary_rpc_method_handler(unary, **ident),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, **ident),
        "Upload": grpc.stream_unary_rpc_method_handler(upload, **ident),
    }
    return Service(
        SERVICE, lambda s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    )


async def test_server_skeleton_maps_errors_and_drains():
    release = asyncio.Event()
    server = create_server("127.0.0.1:0", [_echo_service(release)], {LookupError: grpc.StatusCode.NOT_FOUND})
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        say = ch.unary_unary(f"/{SERVICE}/Say")
        assert await say(b"hello", timeout=10) == b"hello"
        for text, code in [
            ("missing", grpc.StatusCode.NOT_FOUND),
            ("lookup", grpc.StatusCode.NOT_FOUND),
            ("downstream", grpc.StatusCode.INVALID_ARGUMENT),
            ("bug", grpc.StatusCode.INTERNAL),
            ("long", grpc.StatusCode.NOT_FOUND),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await say(text.encode(), timeout=10)
            assert e.value.code() == code, text
            assert len(e.value.details()) <= 1024  # a 50,000-character message travels clipped
        with pytest.raises(grpc.aio.AioRpcError) as e:  # an invalid metadata value must not turn it INTERNAL
            await say(b"odd trailer", timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        tensor = dict(e.value.trailing_metadata())["bitdelta-tensor"]
        assert tensor.startswith("layers.0\\x00") and len(tensor) <= 256
        health = health_pb2_grpc.HealthStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING  # Watch is not wrapped
        call = ch.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10)
        assert await call.read() == b"first"
        drain = asyncio.create_task(server.drain(grace_s=10))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        r = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # still answered while draining
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await say(b"hello", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        assert server.in_flight == 1 and not drain.done()
        release.set()
        assert await call.read() == b"second"  # the call in flight finished within the grace period
        assert await drain is True


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def test_a_process_is_serving_only_once_its_startup_has_finished():
    """run_until_signal: NOT_SERVING while `startup` runs (a server made with serving=True too, as
    the delta store's), SERVING after it; a startup that fails never said SERVING and exits 1."""
    ready = asyncio.Event()

    async def startup():
        await ready.wait()

    server = create_server("127.0.0.1:0", [_echo_service(asyncio.Event())])
    life = asyncio.create_task(run_until_signal(server, 1.0, startup=startup()))
    try:
        for _ in range(20):
            await asyncio.sleep(0.05)
            assert await _health(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        ready.set()
        deadline = time.monotonic() + 10
        while await _health(server.port) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:  # no signal to this process: its handlers may not be installed yet if this failed early
        life.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await life
        await server.stop(0)

    server = create_server("127.0.0.1:0", [_echo_service(asyncio.Event())])
    seen = []

    async def failing():
        await asyncio.sleep(0.2)
        seen.append(await _health(server.port))  # while it runs
        raise RuntimeError("the backend refused")

    with pytest.raises(SystemExit) as e:  # awaited here: a SystemExit leaves a task through the loop
        await run_until_signal(server, 1.0, startup=failing())
    assert e.value.code == 1 and seen == [health_pb2.HealthCheckResponse.NOT_SERVING]


async def test_a_second_server_cannot_take_a_served_port():
    # gRPC's default SO_REUSEPORT would let it bind and take half the connections
    first = create_server("127.0.0.1:0", [_echo_service(asyncio.Event())])
    await first.start()
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            create_server(f"127.0.0.1:{first.port}", [_echo_service(asyncio.Event())])
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            create_server("127.0.0.1:0", [_echo_service(asyncio.Event())], health_address=f"127.0.0.1:{first.port}")
    finally:
        await first.stop(None)


async def test_a_public_server_names_no_address_in_its_errors():
    """The router's server is `public`: a downstream message keeps its meaning and its code, not the
    deployment's addresses (status message and trailers); an internal server passes it whole."""
    for public in (True, False):
        server = create_server("127.0.0.1:0", [_echo_service(asyncio.Event())], public=public)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(f"/{SERVICE}/Say")(b"leaky", timeout=10)
        finally:
            await server.stop(0)
        details, trailers = e.value.details(), dict(e.value.trailing_metadata())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        if not public:
            assert details == LEAKY and trailers["bitdelta-where"] == "worker 10.1.2.3:50061"
            continue
        for address in ("10.0.0.7", "50051", "store-0", "fd00::7", "/run/store.sock", "s3.internal", "10.1.2.3"):
            assert address not in details and address not in str(trailers), (address, details, trailers)
        assert details.startswith("delta 'v0' could not be loaded: delta store <internal address> Fetch('v0')")
        assert "Connection refused" in details and trailers["bitdelta-where"] == "worker <internal address>"


def test_without_addresses_leaves_other_text_alone():
    text = "sampling.max_new_tokens: 300 is more than 256 at 12:30 (rank 1 of 2); model 'qwen:7'; 253 of 256; tools[0] and messages[12]:"
    assert without_addresses(text) == text
    assert without_addresses("to localhost:50051 and 127.0.0.1") == "to <internal address> and <internal address>"


def test_status_kept_across_hops():
    class Wrapped(ServiceError):
        def __init__(self, cause):
            self.code = status_of(cause, {})

    downstream = RpcError("x", grpc.StatusCode.NOT_FOUND)
    assert status_of(downstream, {Exception: grpc.StatusCode.UNAVAILABLE}) == grpc.StatusCode.NOT_FOUND
    assert status_of(Wrapped(downstream), {}) == grpc.StatusCode.NOT_FOUND
    assert status_of(KeyError("k"), {LookupError: grpc.StatusCode.NOT_FOUND}) == grpc.StatusCode.NOT_FOUND
    assert status_of(ValueError("v"), {}) == grpc.StatusCode.INTERNAL
    assert not downstream.retryable and RpcError("y", grpc.StatusCode.UNAVAILABLE).retryable
    assert clip("abc") == "'abc'" and "(10000 characters)" in clip("z" * 10_000) and len(clip("z" * 10_000)) < 120


@dataclass(frozen=True)
class DemoConfig(ServiceConfig):
    """A demo service."""

    ENV_PREFIX: ClassVar[str] = "DEMO_"
    root: Path = setting(help="a directory")
    address: str = setting("[::]:1", "HOST:PORT", check=check_address)
    peers: tuple[str, ...] = setting((), "comma-separated", parse=parse_list)
    budget: int = setting(1 << 20, "bytes", parse=parse_bytes)
    verify: bool = setting(True, "check things")
    ratio: float = setting(0.5, "a ratio")

    def check(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ConfigError(f"{self.flag_of('ratio')} must be in [0, 1]")


def test_typed_config_from_flags_and_environment(tmp_path):
    env = {"DEMO_ROOT": str(tmp_path), "DEMO_BUDGET": "2GiB", "DEMO_VERIFY": "false", "DEMO_PEERS": "a:1,b:2"}
    c = DemoConfig.from_args(["--budget", "3MiB"], env=env)
    assert (c.root, c.budget, c.verify, c.peers, c.ratio) == (tmp_path, 3 << 20, False, ("a:1", "b:2"), 0.5)
    assert DemoConfig.from_args(["--verify"], env=env).verify is True
    assert DemoConfig.from_args(["--no-verify", "--root", "/x"], env={}).verify is False
    assert DemoConfig.from_args(["--verify=false", "--root", "/x"], env={}).verify is False
    for argv, env, words in [
        ([], {}, "--root (or DEMO_ROOT) is required"),
        (["--root", "/x", "--budget", "lots"], {}, "--budget (or DEMO_BUDGET) = 'lots'"),
        (["--root", "/x", "--address", "nowhere"], {}, "--address (or DEMO_ADDRESS) = nowhere: must be HOST:PORT"),
        (["--root", "/x"], {"DEMO_RATIO": "2"}, "--ratio (DEMO_RATIO) must be in [0, 1]"),
        (["--root", "/x", "--verify", "maybe"], {}, "expected true or false"),
    ]:
        with pytest.raises(ConfigError) as e:
            DemoConfig.from_args(argv, env=env)
        assert words in str(e.value), str(e.value)


async def test_a_refused_client_stream_reports_its_status_every_time():
    """grpc's asyncio client turns the server's status into INTERNAL "Internal error from Core" when
    the server ends a client-streaming call while a message is in flight (grpc/grpc#36066). Through
    the skeleton's handshake (bitdelta.rpc.client_stream) every refusal arrives with its own code:
    at the header, part-way, and for a client that streams without waiting for the answer."""
    server = create_server("127.0.0.1:0", [_echo_service(asyncio.Event())], {Missing: grpc.StatusCode.NOT_FOUND})
    await server.start()
    mib = b"x" * (1 << 20)
    started = []

    async def pieces(n=16):
        started.append(True)
        for _ in range(n):
            yield mib

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            upload = ch.stream_unary(f"/{SERVICE}/Upload")
            assert await call_with_handshake(upload(timeout=30), b"ok", pieces()) == str(16 << 20).encode()
            started.clear()
            for header in [b"missing", b"later"] * 8:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call_with_handshake(upload(timeout=30), header, pieces())
                assert e.value.code() == grpc.StatusCode.NOT_FOUND, (header, e.value.details())
            assert len(started) == 8  # a refused header never started reading the data

            async def no_handshake(header):
                yield header
                async for p in pieces():
                    yield p

            for header in [b"missing", b"later"] * 4:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await upload(no_handshake(header), timeout=30)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND, (header, e.value.details())
            assert server.in_flight == 0
    finally:
        await server.stop(0)


async def test_a_refused_client_that_never_finishes_gets_its_status_after_the_drain_timeout(monkeypatch):
    """A client that sends a refused header and then neither waits for the answer nor half-closes
    holds the handler only DRAIN_TIMEOUT_S, then gets the status."""
    monkeypatch.setattr(client_stream, "DRAIN_TIMEOUT_S", 0.5)
    server = create_server("127.0.0.1:0", [_echo_service(asyncio.Event())], {Missing: grpc.StatusCode.NOT_FOUND})
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            call = ch.stream_unary(f"/{SERVICE}/Upload")(timeout=30)
            await call.write(b"missing")  # and then nothing: no more data, no half-close
            t = time.monotonic()
            assert await call.code() == grpc.StatusCode.NOT_FOUND
            assert 0.2 < time.monotonic() - t < 10  # it waited for the client, then gave up
    finally:
        await server.stop(0)
