"""Fixtures for the delta store's tests: delta files, backends under test, running servers.

Loaded as a pytest plugin together with `tests.support.swift`. Nothing here
is a mock: deltas are real delta files (written with `bitdelta.format`, or
compressed from the tiny random Llama family), backends are the real local
directory and a real Swift, servers listen on loopback ports.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bitdelta.format import V1_LAYOUT, DeltaMeta, write_delta
from bitdelta.rpc.clients.delta_store import DeltaStoreClient
from bitdelta.rpc.serve import Server
from services.delta_store.backends import SUFFIX, Backend
from services.delta_store.backends.local import LocalBackend
from services.delta_store.config import Config
from services.delta_store.server import create_server
from services.delta_store.store import DeltaStore
from tests.support.swift import TcpRelay

BASE_FP = "f" * 64


def make_delta(
    path: Path,
    variant: str = "v",
    seed: int = 0,
    base_fingerprint: str = BASE_FP,
    shapes: dict[str, tuple[int, int]] | None = None,
    dense: dict[str, tuple[int, ...]] | None = None,
    alpha_mode: str = "row",
) -> Path:
    """A valid delta file with random signs and scales (signs drawn as raw bytes: no float matrix needed)."""
    g = torch.Generator().manual_seed(seed)
    shapes = (
        shapes
        if shapes is not None
        else {"model.layers.0.self_attn.q_proj.weight": (64, 100), "model.layers.0.mlp.up_proj.weight": (172, 64)}
    )
    dense = dense if dense is not None else {"model.norm.weight": (64,)}
    tensors = {}
    for p, (d_out, d_in) in shapes.items():
        tensors[p + ".sign"] = torch.randint(0, 256, (d_out, (d_in + 7) // 8), dtype=torch.uint8, generator=g)
        tensors[p + ".alpha"] = torch.rand(d_out if alpha_mode == "row" else 1, generator=g)
    for p, shape in dense.items():
        tensors[p + ".dense"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    meta = DeltaMeta(
        variant=variant,
        base_model="tiny-test",
        base_fingerprint=base_fingerprint,
        alpha_mode=alpha_mode,
        architecture="llama",
        layout=V1_LAYOUT,
        shapes={p: list(s) for p, s in shapes.items()},
    )
    write_delta(path, tensors, meta)
    return path


def big_delta(path: Path, mib: int, seed: int = 0) -> Path:
    """A delta of about `mib` MiB in one large sign tensor plus small ones."""
    d_out = mib * 64  # rows of 16 KiB packed signs
    return make_delta(
        path,
        variant=path.stem,
        seed=seed,
        shapes={
            "model.layers.0.mlp.down_proj.weight": (d_out, 16384 * 8),
            "model.layers.0.self_attn.q_proj.weight": (64, 100),
        },
    )


@pytest.fixture(scope="session")
def tiny_deltas(tmp_path_factory) -> dict[str, Path]:
    """Real deltas: the tiny random Llama family, compressed by `bitdelta.compress`."""
    from bitdelta.compress import compress
    from tests.support.family import make_tiny_family

    root = tmp_path_factory.mktemp("family")
    base, variants = make_tiny_family(root, n_variants=2)
    out = {}
    for i, v in enumerate(variants):
        name = f"tiny-{i}"
        out[name] = compress(
            base, v, root / f"{name}{SUFFIX}", alpha_mode="row" if i == 0 else "matrix", variant=name, progress=False
        )
    return out


@dataclass
class BackendUnderTest:
    """A backend with the means to write raw objects and to take it down and up."""

    kind: str
    make: Callable[[], Backend]  # a fresh client of the same store
    put_raw: Callable[[str, bytes], None]  # bypasses every check, like an operator or bit rot
    down: Callable[[], None]
    up: Callable[[], None]
    root: Path | None = None
    s3: dict = field(default_factory=dict)


@pytest.fixture(params=["local", "s3"])
def backend_under_test(request, tmp_path) -> BackendUnderTest:
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        away = tmp_path / "store-unmounted"

        def put_raw(name: str, data: bytes) -> None:
            (root / (name + SUFFIX)).write_bytes(data)

        yield BackendUnderTest(
            "local",
            lambda: LocalBackend(root),
            put_raw,
            down=lambda: os.rename(root, away),
            up=lambda: os.rename(away, root),
            root=root,
        )
        if away.exists() and not root.exists():
            os.rename(away, root)
        shutil.rmtree(root, ignore_errors=True)
        return

    from services.delta_store.backends.s3 import S3Backend

    swift = request.getfixturevalue("swift")
    bucket = swift.new_bucket()
    host, port = swift.endpoint.rsplit("/", 1)[1].split(":")
    relay = TcpRelay(host, int(port))
    s3 = swift.client()
    kw = dict(
        bucket=bucket,
        endpoint=relay.url,
        access_key=swift.access_key,
        secret_key=swift.secret_key,
        region=swift.region,
        timeout_s=2.0,
    )

    def put_raw(name: str, data: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=name + SUFFIX, Body=data)

    yield BackendUnderTest(
        "s3",
        lambda: S3Backend(**kw),
        put_raw,
        down=relay.down,
        up=relay.up,
        s3={"client": s3, "bucket": bucket, "relay": relay},
    )
    relay.close()


@dataclass
class RunningStore:
    server: Server
    store: DeltaStore
    client: DeltaStoreClient

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def start_store():
    """`await start_store(backend, **config)`: a delta store server on a free loopback port, with a client."""
    running: list[RunningStore] = []

    async def start(backend: Backend, tracer_provider=None, **config) -> RunningStore:
        cfg = Config(address="127.0.0.1:0", backend=getattr(backend, "kind", "local"), **config)
        server, store = create_server(cfg, backend=backend, tracer_provider=tracer_provider)
        await server.start()
        r = RunningStore(server, store, DeltaStoreClient(f"127.0.0.1:{server.port}", timeout_s=10, fetch_timeout_s=60))
        running.append(r)
        return r

    yield start
    for r in running:
        await r.client.close()
        await r.server.stop(0)
        await r.store.close()
