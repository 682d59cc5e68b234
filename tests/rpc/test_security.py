"""Transport security and access control (issue #12): a delta store, a worker and a router as
processes on loopback, all serving mutual TLS with certificates from `bitdelta.rpc.certs`, all
reading one tokens file. A client with the CA's client certificate and an allowed token gets
tokens end to end (router -> worker -> store over mTLS); everything else is refused with the
code that says why. Auth off is the rest of the suite (test_router.py and friends run without it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.rpc import security
from bitdelta.rpc.certs import make_all
from bitdelta.rpc.clients.delta_store import DeltaStoreClient
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.rpc.config import ConfigError
from bitdelta.rpc.errors import RpcError
from bitdelta.testing.cluster import Cluster, free_port, tls_flags
from bitdelta.testing.family import make_test_family
from tests.support.tls import creds

aio = pytest.mark.asyncio(loop_scope="module")  # the async tests share the module's cluster

T = 120  # deadline (s) of client calls: the machine may be busy
ALICE = "alice-7f3c9a1e-token"  # may use v0 only
BOB = "bob-52d1-token"  # may use the base only (by the alias "base")
OPS = "ops-admin-0b6e-token"  # admin, every model
SECRETS = (ALICE, BOB, OPS)


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_all(d, ["router", "worker", "delta-store", "client"])
    make_all(d / "other", ["client"])  # a second CA: its certificates must be refused everywhere
    return d


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tokens") / "tokens.json"
    p.write_text(
        json.dumps(
            {
                f"sha256:{sha(ALICE)}": {"name": "alice", "variants": ["v0"]},
                f"sha256:{sha(BOB)}": {"name": "bob", "variants": ["base"]},
                OPS: {"name": "ops", "variants": "*", "admin": True},  # a plain key works too (demos)
            }
        )
    )
    return p


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("security_family"), n_variants=2, merged=False)


@pytest.fixture(scope="module")
def cluster(family, certs, tokens_file, tmp_path_factory):
    work = tmp_path_factory.mktemp("security_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    auth = ("--tokens-file", str(tokens_file))
    with Cluster(work, credentials=creds(certs)) as c:
        c.root = root
        c.health = f"127.0.0.1:{free_port()}"  # the store's plain-text health port (Kubernetes probes)
        c.st = c.store(root, extra=(*tls_flags(certs, "delta-store"), *auth, "--health-address", c.health))
        c.w = c.worker(family.base, c.st.address, extra=(*tls_flags(certs, "worker"), *auth))
        c.r = c.router([c.w.address], c.st.address, extra=(*tls_flags(certs, "router"), *auth))
        c.wait_serving(c.st, c.w, c.r)
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ops(cluster, certs):
    """The admin's router client, once the router sees its worker up and the store's variants."""
    async with RouterClient(cluster.r.address, credentials=creds(certs), token=OPS, generate_timeout_s=T) as r:
        for _ in range(600):  # workers up and the store's variants known (the store may start after the router)
            known = {m.model_id for m in await r.list_models()}
            if all(w.up for w in await r.list_workers()) and {"v0", "v1"} <= known:
                break
            await asyncio.sleep(0.2)
        yield r


async def codes_of(aw) -> grpc.StatusCode:
    with pytest.raises(RpcError) as e:
        await aw
    return e.value.code


async def collect(r: RouterClient, model: str, n: int = 6, **kw) -> list:
    return [m async for m in r.generate(model, "Hello world", max_new_tokens=n, **kw)]


async def tokens_of(r: RouterClient, model: str, n: int = 6, **kw) -> list:
    """The tokens of a stream (a message holds every token ready when it was written)."""
    return [t for m in await collect(r, model, n, **kw) for t in m.tokens]


@aio
async def test_mutual_tls_end_to_end(cluster, certs, ops):
    """router -> worker -> store, each hop mutual TLS: a cold variant is fetched and answered."""
    async with RouterClient(cluster.r.address, credentials=creds(certs), token=ALICE, generate_timeout_s=T) as r:
        out = await collect(r, "v0")
    assert sum(len(m.tokens) for m in out) == 6 and out[0].worker == cluster.w.address
    async with WorkerClient(cluster.w.address, credentials=creds(certs)) as w:
        st = await w.status()
    assert "v0" in {s.name for s in st.slots if s.state}, st  # the worker fetched it from the store over mTLS


@aio
@pytest.mark.parametrize("service", ["st", "w", "r"])
async def test_each_service_refuses_clients_without_a_certificate_of_its_ca(cluster, certs, service):
    address = getattr(cluster, service).address
    refused = {
        "no client certificate": grpc.aio.secure_channel(address, creds(certs, who=None)),
        "a certificate from another CA": grpc.aio.secure_channel(address, creds(certs, who="other")),
        "plain text": grpc.aio.insecure_channel(address),
        "a server from another CA (client side)": grpc.aio.secure_channel(
            address, creds(certs, who="client", ca=certs / "other" / "ca.pem")
        ),
    }
    for why, channel in refused.items():
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (why, e.value)
    async with grpc.aio.secure_channel(address, creds(certs)) as ok:  # the control: the CA's client certificate
        r = await health_pb2_grpc.HealthStub(ok).Check(health_pb2.HealthCheckRequest(), timeout=20)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


@aio
async def test_a_refused_connection_says_what_it_likely_means(cluster, certs):
    """gRPC reports both TLS mismatches as a bare "Socket closed"; the project's clients add the likely cause."""
    for client, hint in [
        (DeltaStoreClient(cluster.st.address), "may require TLS, and this client connects in plain text"),
        (
            DeltaStoreClient(cluster.st.address, credentials=creds(certs, who=None)),
            "may require a client certificate signed by its CA",
        ),
    ]:
        async with client:
            with pytest.raises(RpcError) as e:
                await client.list(timeout_s=20)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and hint in str(e.value) and hint in e.value.details, e.value


@aio
async def test_plain_text_health_port_answers_health_and_nothing_else(cluster):
    from bitdelta.delta_store.v1 import delta_store_pb2 as spb
    from bitdelta.delta_store.v1 import delta_store_pb2_grpc as spb_grpc

    async with grpc.aio.insecure_channel(cluster.health) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await spb_grpc.DeltaStoreServiceStub(ch).List(spb.ListRequest(), timeout=20)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


@aio
async def test_router_tokens(cluster, certs, ops):
    addr, cc = cluster.r.address, creds(certs)
    async with (
        RouterClient(addr, credentials=cc, generate_timeout_s=T) as anon,
        RouterClient(addr, credentials=cc, token="not-a-token", generate_timeout_s=T) as bogus,
        RouterClient(addr, credentials=cc, token=ALICE, generate_timeout_s=T) as alice,
        RouterClient(addr, credentials=cc, token=BOB, generate_timeout_s=T) as bob,
    ):
        with pytest.raises(RpcError) as e:
            await collect(anon, "v0")
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in e.value.details
        assert await codes_of(collect(bogus, "v0")) == grpc.StatusCode.UNAUTHENTICATED
        assert await codes_of(anon.list_models()) == grpc.StatusCode.UNAUTHENTICATED
        bad = (("authorization", f"Basic {ALICE}"),)
        assert await codes_of(collect(anon, "v0", metadata=bad)) == grpc.StatusCode.UNAUTHENTICATED

        with pytest.raises(RpcError) as e:
            await collect(alice, "v1")
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "alice" in e.value.details and "v0" in e.value.details and ALICE not in e.value.details
        assert await codes_of(collect(alice, "")) == grpc.StatusCode.PERMISSION_DENIED  # the base is not hers
        assert await codes_of(collect(alice, "no-such-model")) == grpc.StatusCode.PERMISSION_DENIED  # not NOT_FOUND
        assert await codes_of(alice.list_workers()) == grpc.StatusCode.PERMISSION_DENIED  # admin only

        assert len(await tokens_of(bob, "")) == 6  # "base" in his list allows the base, by "" ...
        base_name = next(m.model_id for m in await ops.list_models() if m.is_base)
        assert len(await tokens_of(bob, base_name, n=2)) == 2  # ... and by its name
        assert await codes_of(collect(bob, "v0")) == grpc.StatusCode.PERMISSION_DENIED

        # exactly what the gateway sends: its caller's `Authorization` header as the metadata `authorization`
        assert len(await tokens_of(anon, "v0", n=2, metadata=(("authorization", f"Bearer {ALICE}"),))) == 2

        assert [m.model_id for m in await alice.list_models()] == ["v0"]
        assert [m.is_base for m in await bob.list_models()] == [True]
    every = {m.model_id for m in await ops.list_models()}
    assert {"v0", "v1", base_name} <= every
    assert [w.address for w in await ops.list_workers()] == [cluster.w.address]


@aio
async def test_admin_methods_need_an_admin_token(cluster, certs, family):
    cc = creds(certs)
    data = family.delta_path("v1").read_bytes()
    async with (
        DeltaStoreClient(cluster.st.address, credentials=cc) as anon,
        DeltaStoreClient(cluster.st.address, credentials=cc, token=ALICE) as alice,
        DeltaStoreClient(cluster.st.address, credentials=cc, token=OPS) as admin,
    ):
        assert await codes_of(anon.put("v1copy", data)) == grpc.StatusCode.UNAUTHENTICATED
        assert await codes_of(alice.put("v1copy", data)) == grpc.StatusCode.PERMISSION_DENIED
        assert (await admin.put("v1copy", data)).name == "v1copy"
        assert "v1copy" in {d.name for d in await anon.list()}  # reading needs no token (mTLS gates it)
        assert await codes_of(anon.delete("v1copy")) == grpc.StatusCode.UNAUTHENTICATED
        assert await codes_of(alice.delete("v1copy")) == grpc.StatusCode.PERMISSION_DENIED
        await admin.delete("v1copy")
        assert "v1copy" not in {d.name for d in await anon.list()}

    async with (
        WorkerClient(cluster.w.address, credentials=cc, generate_timeout_s=T) as anon,
        WorkerClient(cluster.w.address, credentials=cc, token=ALICE, generate_timeout_s=T) as alice,
        WorkerClient(cluster.w.address, credentials=cc, token=OPS, generate_timeout_s=T) as admin,
    ):
        assert await codes_of(anon.load_delta("v1")) == grpc.StatusCode.UNAUTHENTICATED
        assert await codes_of(alice.load_delta("v1")) == grpc.StatusCode.PERMISSION_DENIED
        await admin.load_delta("v1")
        assert "v1" in {s.name for s in (await anon.status()).slots if s.state}  # Status: the router's poll, open
        assert await codes_of(anon.evict_delta("v1")) == grpc.StatusCode.UNAUTHENTICATED
        assert await codes_of(alice.evict_delta("v1")) == grpc.StatusCode.PERMISSION_DENIED
        await admin.evict_delta("v1")


def test_cli_reaches_a_secure_router_with_the_variables(cluster, certs):
    """`bitdelta models` with BITDELTA_TLS_* and BITDELTA_TOKEN: alice's models only; without: refused."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "BITDELTA_TLS_CA": str(certs / "ca.pem"),
        "BITDELTA_TLS_CERT": str(certs / "client.pem"),
        "BITDELTA_TLS_KEY": str(certs / "client.key"),
        "BITDELTA_TOKEN": ALICE,
    }
    argv = [
        sys.executable,
        "-c",
        "from bitdelta.cli import main; raise SystemExit(main())",
        "models",
        "--router",
        cluster.r.address,
    ]
    ok = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "v0" in ok.stdout and "v1" not in ok.stdout
    no_token = subprocess.run(argv, env={**env, "BITDELTA_TOKEN": ""}, capture_output=True, text=True, timeout=120)
    assert no_token.returncode != 0 and "UNAUTHENTICATED" in no_token.stderr


@aio
async def test_no_service_logs_a_token(cluster, ops):
    """Run after the refusals above (each is logged, by the token's name at most)."""
    for p in (cluster.st, cluster.w, cluster.r):
        text = p.log_text()
        for secret in SECRETS:
            assert secret not in text, f"{p.name} logged a token"


# -- the pieces, without processes ------------------------------------------------------------------
def test_partial_tls_settings_are_refused(certs, tmp_path):
    from services.router.config import RouterConfig

    need = ["--workers", "127.0.0.1:1", "--delta-store", "127.0.0.1:2"]
    with pytest.raises(ConfigError, match="go together"):
        RouterConfig.from_args([*need, "--tls-cert", str(certs / "router.pem")])
    with pytest.raises(ConfigError, match="--tls-ca turns TLS on"):
        RouterConfig.from_args([*need, "--tls-ca", str(certs / "ca.pem")])
    with pytest.raises(ConfigError, match="needs --tls-ca"):
        RouterConfig.from_args([*need, "--tls-cert", str(certs / "router.pem"), "--tls-key", str(certs / "router.key")])
    with pytest.raises(ConfigError, match="no such file"):
        RouterConfig.from_args([*need, *tls_flags(tmp_path, "router")])
    c = RouterConfig.from_args(
        need,
        env={
            "BITDELTA_ROUTER_TLS_CA": str(certs / "ca.pem"),
            "BITDELTA_ROUTER_TLS_CERT": str(certs / "router.pem"),
            "BITDELTA_ROUTER_TLS_KEY": str(certs / "router.key"),
        },
    )
    assert c.tls_on and c.tls_client_auth and c.server_credentials() is not None
    assert RouterConfig.from_args(need).server_credentials() is None  # off by default


@pytest.mark.parametrize(
    "text, error",
    [
        ("[]", "must be a JSON object"),
        ('{"t": {"variants": "*"}}', "'name'"),
        ('{"t": {"name": "a", "variants": "v0"}}', "'variants'"),
        ('{"t": {"name": "a", "admin": "yes"}}', "'admin'"),
        ('{"t": {"name": "a", "role": "x"}}', "unknown fields"),
        ('{"sha256:12": {"name": "a"}}', "64 hex digits"),
        ('{"t": {"name": "a"}, "sha256:' + sha("t") + '": {"name": "b"}}', "the same token as 'a'"),
        ("{nope", "not JSON"),
    ],
)
def test_tokens_file_errors_name_the_entry_never_the_token(text, error):
    with pytest.raises(ValueError, match=error) as e:
        security.parse_tokens(text)
    assert '"t"' not in str(e.value) and "'t'" not in str(e.value)


def test_tokens_file_is_reread_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(security, "RELOAD_CHECK_S", 0.0)
    p = tmp_path / "tokens.json"
    p.write_text(json.dumps({"one": {"name": "a", "variants": ["v0"]}}))
    table = security.TokenTable(p)
    assert table.lookup("one").name == "a" and table.lookup("two") is None
    p.write_text(json.dumps({"two": {"name": "b", "variants": "*", "admin": True}}))
    assert table.lookup("one") is None and table.lookup("two").admin
    p.write_text("{broken")  # a bad new version keeps the table that worked
    assert table.lookup("two").admin


def test_principal_may_use():
    p = security.Principal("a", frozenset({"v0", "base"}))
    assert p.may_use("v0") and not p.may_use("v1") and p.may_use("Smol", is_base=True)
    assert security.Principal("b", None).may_use("anything")
    assert not security.Principal("c", frozenset({"v0"})).may_use("Smol", is_base=True)


def test_bearer_token_parsing():
    assert security.bearer_token((("authorization", "Bearer abc"),)) == "abc"
    assert security.bearer_token((("Authorization", "bearer  abc "),)) == "abc"
    assert security.bearer_token((("authorization", "Basic abc"),)) == ""
    assert security.bearer_token((("x", "y"),)) is None


def test_certificates_name_loopback_and_kubernetes_services(certs):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((certs / "worker.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(san.get_values_for_type(x509.DNSName))
    assert {"localhost", "worker", "worker.bitdelta.svc", "*.worker.bitdelta.svc.cluster.local"} <= names
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert oct((certs / "worker.key").stat().st_mode & 0o777) == "0o600"


# -- Kubernetes: the manifests turn it all on ---------------------------------------------------------
def test_k8s_services_run_mutual_tls_and_tokens_from_secrets(tmp_path):
    """Every gRPC service's container gets the TLS files, the tokens file and a plain health port
    from its environment, mounted from the Secrets `python -m bitdelta.rpc.certs --k8s-secrets` writes,
    and probes that port; its config accepts exactly those settings."""
    import yaml

    from bitdelta.rpc.certs import k8s_secrets, make_tokens
    from tests.support.deploy import config_class, image_modules, k8s_objects

    names = ["router", "gpu-worker", "delta-store", "gateway"]
    make_all(tmp_path, names)
    make_tokens(tmp_path)
    made = {d["metadata"]["name"] for d in yaml.safe_load_all(k8s_secrets(tmp_path, names))}
    modules = image_modules() | {"bitdelta/worker:cuda": "services.gpu_worker"}
    seen = set()
    for obj in k8s_objects():
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec["containers"]:
            module = modules.get(c["image"])
            if module is None:
                continue
            seen.add(module)
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
            assert secrets[mounts["/etc/bitdelta/tls"]] in made, c["name"]
            env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("BITDELTA_")}
            prefix = config_class(module).ENV_PREFIX
            files = {
                "/etc/bitdelta/tls/ca.pem": tmp_path / "ca.pem",
                "/etc/bitdelta/tls/tls.pem": tmp_path / f"{obj['metadata']['name']}.pem",
                "/etc/bitdelta/tls/tls.key": tmp_path / f"{obj['metadata']['name']}.key",
                "/etc/bitdelta/tokens/tokens.json": tmp_path / "tokens.json",
            }
            config = config_class(module).from_args(
                _fixed_args(c["args"], tmp_path / "p"), env={k: str(files.get(v, v)) for k, v in env.items()}
            )
            assert config.tls_on and config.tls_cert is not None, c["name"]
            if module == "services.gateway":
                continue  # a client of the router only
            assert config.tls_client_auth and config.tokens() is not None, c["name"]
            assert secrets[mounts["/etc/bitdelta/tokens"]] in made
            health = int(env[prefix + "HEALTH_ADDRESS"].rsplit(":", 1)[1])
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["health"] == health
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["grpc"]["port"] == health, (c["name"], probe)
    assert seen == {"services.router", "services.delta_store", "services.gpu_worker", "services.gateway"}


def _fixed_args(argv: list[str], tmp: Path) -> list[str]:
    """`argv` with the checkpoint and store paths pointed at directories that exist."""
    base = tmp / "base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text("{}")
    (base / "tokenizer.json").write_text("{}")
    return [
        str(base) if prev in ("--base", "--chat-template") else str(tmp) if prev == "--root" else a
        for prev, a in zip(["", *argv], argv)
    ]
