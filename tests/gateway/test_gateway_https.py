"""The gateway's own HTTP listener over TLS (issue #12): `--https-cert/--https-key` serve HTTPS,
`--https-client-ca` also requires client certificates (mutual TLS). Gateway + router + worker +
delta store as processes on loopback (as in test_gateway.py), certificates from the project's own
`bitdelta.rpc.certs`; the clients are the official `openai` SDK and the standard library's
`http.client`/`ssl`. Nothing is mocked.

The gateway -> router hop is plain gRPC in the `cluster` fixture (that hop's TLS is the separate --tls-*
setting); `tls_cluster` encrypts both hops: client -HTTPS-> gateway -mTLS-> router -mTLS-> worker/store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from bitdelta.rpc.certs import make_all
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.rpc.config import ConfigError
from bitdelta.rpc.errors import RpcError
from bitdelta.testing.cluster import ROOT, Cluster, Proc, free_port, tls_flags
from services.gateway.config import GatewayConfig
from tests.support.tls import creds  # gRPC channel credentials: our CA, our client certificate

T = 60  # client deadlines (s): the machine may be busy
N = 8  # new tokens per generation
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """ca.pem + gateway/client/router/worker/delta-store .pem/.key, and a second CA's client certificate
    in other/."""
    d = tmp_path_factory.mktemp("https_certs")
    make_all(d, ["gateway", "client", "router", "worker", "delta-store"])
    make_all(d / "other", ["client"])
    return d


def https_flags(certs: Path, client_ca: bool = False) -> tuple[str, ...]:
    out = ("--https-cert", str(certs / "gateway.pem"), "--https-key", str(certs / "gateway.key"))
    return (*out, "--https-client-ca", str(certs / "ca.pem")) if client_ca else out


def client_context(certs: Path, ca: Path | None = None, who: str | None = None) -> ssl.SSLContext:
    """Trust `ca` (default our CA's ca.pem); present `who`'s certificate: "client" (ours), "other"
    (the second CA's) or None (none)."""
    ctx = ssl.create_default_context(cafile=str(ca or certs / "ca.pem"))
    if who is not None:
        d = certs / "other" if who == "other" else certs
        ctx.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
    return ctx


def get(address: str, path: str, context: ssl.SSLContext | None) -> tuple[int, object]:
    """(status, JSON) of one GET; HTTPS with `context`, plain HTTP without."""
    host, port = address.rsplit(":", 1)
    conn = (
        http.client.HTTPSConnection(host, int(port), context=context, timeout=T)
        if context
        else http.client.HTTPConnection(host, int(port), timeout=T)
    )
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def wait_https(p: Proc, context: ssl.SSLContext, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not p.alive():
            raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_text()[-4000:]}")
        try:
            if get(p.address, "/health", context)[0] == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{p.name} did not answer /health over HTTPS in {timeout:.0f} s:\n{p.log_text()[-4000:]}"
            )
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(family, certs, tmp_path_factory):
    """Store, worker, router; gateways: HTTPS (`g`), HTTPS requiring client certificates (`g_mtls`)."""
    work = tmp_path_factory.mktemp("https_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    with Cluster(work) as c:
        c.st = c.store(root)
        c.w = c.worker(family.base, c.st.address)
        c.r = c.router([c.w.address], c.st.address)
        c.g = c.gateway(c.r.address, extra=https_flags(certs), wait=False)
        c.g_mtls = c.gateway(c.r.address, name="gateway-mtls", extra=https_flags(certs, client_ca=True), wait=False)
        c.wait_serving(c.st, c.w, c.r)
        wait_https(c.g, client_context(certs))
        wait_https(c.g_mtls, client_context(certs, who="client"))
        asyncio.run(router_ready(c.r.address))
        yield c


@pytest.fixture(scope="module")
def tls_cluster(family, certs, tmp_path_factory):
    """Store, worker, router serving mutual TLS to each other (as in test_security.py, without tokens);
    gateways serving HTTPS and calling the router over TLS: `g` presents its certificate (gateway.pem, the
    one it serves HTTPS with), `g_nocert` verifies the router against the CA but presents none."""
    work = tmp_path_factory.mktemp("https_tls_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    with Cluster(work, credentials=creds(certs)) as c:
        c.st = c.store(root, extra=tls_flags(certs, "delta-store"))
        c.w = c.worker(family.base, c.st.address, extra=tls_flags(certs, "worker"))
        c.r = c.router([c.w.address], c.st.address, extra=tls_flags(certs, "router"))
        c.g = c.gateway(c.r.address, extra=(*https_flags(certs), *tls_flags(certs, "gateway")), wait=False)
        c.g_nocert = c.gateway(
            c.r.address,
            name="gateway-nocert",
            wait=False,
            extra=(*https_flags(certs), "--tls-ca", str(certs / "ca.pem")),
        )
        c.wait_serving(c.st, c.w, c.r)
        wait_https(c.g, client_context(certs))
        wait_https(c.g_nocert, client_context(certs))
        asyncio.run(router_ready(c.r.address, credentials=creds(certs)))
        yield c


def oai(address: str, context: ssl.SSLContext | None = None) -> openai.AsyncOpenAI:
    """The SDK against https://`address`/v1, verifying with `context` (None: the SDK's default trust)."""
    http_client = openai.DefaultAsyncHttpx2Client(verify=context) if context else None
    return openai.AsyncOpenAI(
        base_url=f"https://{address}/v1", api_key="test-key", max_retries=0, timeout=T, http_client=http_client
    )


async def router_ready(address: str, timeout: float = 120, credentials=None) -> None:
    """Until the router sees its worker up and the store's variants (it polls both)."""
    deadline = time.monotonic() + timeout
    async with RouterClient(address, generate_timeout_s=T, credentials=credentials) as r:
        while True:
            try:
                workers, models = await r.list_workers(), {m.model_id for m in await r.list_models()}
                if workers and all(w.up for w in workers) and {"v0", "v1"} <= models:
                    return
            except RpcError:  # not up yet
                pass
            assert time.monotonic() < deadline, "the router never saw its worker up and the variants"
            await asyncio.sleep(0.1)


async def router_greedy(cluster, model: str, credentials=None) -> str:
    """What the router itself generates for `model` (the reference the gateway must pass through)."""
    async with RouterClient(cluster.r.address, generate_timeout_s=T, credentials=credentials) as r:
        return "".join([t.text async for m in r.generate(model, PROMPT, max_new_tokens=N) for t in m.tokens])


def fails(fn, *args) -> BaseException:
    """The exception `fn(*args)` raised (the test fails if it returned)."""
    try:
        out = fn(*args)
    except (OSError, http.client.HTTPException) as e:
        return e
    pytest.fail(f"expected a failure, got {out!r}")


# -- HTTPS -------------------------------------------------------------------------------------------------
async def test_openai_client_gets_a_completion_over_https(cluster, certs):
    """The SDK, trusting our CA, gets through gateway -> router -> worker exactly the router's text."""
    want = await router_greedy(cluster, "v0")
    async with oai(cluster.g.address, client_context(certs)) as client:
        assert [m.id for m in (await client.models.list()).data][1:] == ["v0", "v1"]
        r = await client.completions.create(model="v0", prompt=PROMPT, max_tokens=N, temperature=0)
    assert want and r.choices[0].text == want and r.usage.completion_tokens == N
    # the certificate names localhost too (what a browser or curl on the host would use)
    port = cluster.g.address.rsplit(":", 1)[1]
    assert get(f"localhost:{port}", "/health", client_context(certs))[0] == 200


def test_plain_http_to_the_https_port_gets_no_answer(cluster, certs):
    e = fails(get, cluster.g.address, "/health", None)
    # the plain client never spoke TLS: the server drops the connection without an HTTP answer
    assert isinstance(e, (ConnectionError, http.client.HTTPException)) and not isinstance(e, ssl.SSLError), e
    assert cluster.g.alive() and get(cluster.g.address, "/health", client_context(certs))[0] == 200


async def test_a_client_that_does_not_trust_the_ca_fails_verification(cluster, certs):
    e = fails(get, cluster.g.address, "/health", client_context(certs, ca=certs / "other" / "ca.pem"))
    assert isinstance(e, ssl.SSLCertVerificationError), e
    e = fails(get, cluster.g.address, "/health", ssl.create_default_context())  # the system's CAs only
    assert isinstance(e, ssl.SSLCertVerificationError), e
    async with oai(cluster.g.address) as client:  # the SDK's default trust: not our local CA
        with pytest.raises(openai.APIConnectionError) as ei:
            await client.models.list()
    chain, x = [], ei.value
    while x is not None:
        chain.append(x)
        x = x.__cause__ or x.__context__
    assert any(isinstance(x, ssl.SSLCertVerificationError) for x in chain), chain


# -- mutual TLS ----------------------------------------------------------------------------------------------
async def test_client_ca_requires_a_certificate_signed_by_it(cluster, certs):
    g = cluster.g_mtls
    # no client certificate: the TLS 1.3 server refuses it after the handshake, before any HTTP
    e = fails(get, g.address, "/health", client_context(certs))
    assert isinstance(e, (ssl.SSLError, ConnectionResetError)), e
    assert not isinstance(e, ssl.SSLCertVerificationError), e  # the client did trust the server
    # a certificate of another CA: refused too
    e = fails(get, g.address, "/health", client_context(certs, who="other"))
    assert isinstance(e, (ssl.SSLError, ConnectionResetError)), e
    async with oai(g.address, client_context(certs)) as client:
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()
    # the HTTPS gateway without --https-client-ca answers the same certificate-less client
    assert get(cluster.g.address, "/health", client_context(certs))[0] == 200
    # ours: a real completion through the mTLS gateway
    want = await router_greedy(cluster, "v1")
    async with oai(g.address, client_context(certs, who="client")) as client:
        r = await client.completions.create(model="v1", prompt=PROMPT, max_tokens=N, temperature=0)
    assert want and r.choices[0].text == want
    assert g.alive()


# -- both hops encrypted -------------------------------------------------------------------------------------
async def test_https_to_the_gateway_and_mutual_tls_behind_it(tls_cluster, certs):
    """client -HTTPS-> gateway -mTLS-> router -mTLS-> worker -mTLS-> store: the SDK, trusting our CA, gets
    exactly the router's own greedy text (the router called directly over mTLS). A gateway without its
    router client certificate, in front of the same router, answers 503 in OpenAI's error shape."""
    c = tls_cluster
    want = await router_greedy(c, "v1", credentials=creds(certs))
    async with oai(c.g.address, client_context(certs)) as client:
        r = await client.completions.create(model="v1", prompt=PROMPT, max_tokens=N, temperature=0)
    assert want and r.choices[0].text == want and r.usage.completion_tokens == N
    assert get(c.g.address, "/ready", client_context(certs)) == (200, {"status": "ok"})

    # the router requires a client certificate: it refuses the certificate-less gateway's TLS handshake
    async with oai(c.g_nocert.address, client_context(certs)) as client:
        with pytest.raises(openai.APIStatusError) as completion:
            await client.completions.create(model="v1", prompt=PROMPT, max_tokens=N, temperature=0)
        with pytest.raises(openai.APIStatusError) as models:
            await client.models.list()
    for e in (completion.value, models.value):
        error = e.response.json()["error"]
        assert e.status_code == 503, (e.status_code, error)
        assert error["type"] == "service_unavailable_error" and error["code"] == "unavailable", error
        assert "Socket closed" in error["message"], error  # gRPC's own text, without the router's address ...
        assert c.r.address not in error["message"] and "127.0.0.1" not in error["message"], error
        assert "may require a client certificate" in error["message"], error  # ... and what it likely means
    status, body = get(c.g_nocert.address, "/ready", client_context(certs))
    assert status == 503 and body["status"] == "router unavailable", (status, body)
    assert c.g_nocert.alive() and c.r.alive()


# -- configuration -------------------------------------------------------------------------------------------
def test_https_settings_from_the_environment(certs):
    env = {
        "BITDELTA_GATEWAY_ROUTER": "127.0.0.1:1",
        "BITDELTA_GATEWAY_HTTPS_CERT": str(certs / "gateway.pem"),
        "BITDELTA_GATEWAY_HTTPS_KEY": str(certs / "gateway.key"),
        "BITDELTA_GATEWAY_HTTPS_CLIENT_CA": str(certs / "ca.pem"),
    }
    c = GatewayConfig.from_args([], env=env)
    assert c.https_on and c.uvicorn_ssl() == {
        "ssl_certfile": str(certs / "gateway.pem"),
        "ssl_keyfile": str(certs / "gateway.key"),
        "ssl_ca_certs": str(certs / "ca.pem"),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    assert not c.tls_on  # the router-facing --tls-* settings are separate
    plain = GatewayConfig.from_args(["--router", "127.0.0.1:1"], env={})
    assert not plain.https_on and plain.uvicorn_ssl() == {}
    env.pop("BITDELTA_GATEWAY_HTTPS_KEY")
    with pytest.raises(ConfigError, match="BITDELTA_GATEWAY_HTTPS_KEY"):
        GatewayConfig.from_args([], env=env)


def bad_flag_cases(certs: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (flags, what stderr must say)."""
    (tmp / "garbage.pem").write_text("not a certificate\n")
    cert, key, ca = str(certs / "gateway.pem"), str(certs / "gateway.key"), str(certs / "ca.pem")
    return {
        "cert without key": (["--https-cert", cert], "--https-cert (BITDELTA_GATEWAY_HTTPS_CERT) needs --https-key"),
        "key without cert": (["--https-key", key], "--https-key (BITDELTA_GATEWAY_HTTPS_KEY) needs --https-cert"),
        "client CA without cert": (
            ["--https-client-ca", ca],
            "--https-client-ca (BITDELTA_GATEWAY_HTTPS_CLIENT_CA) needs --https-cert",
        ),
        "missing cert": (
            ["--https-cert", str(tmp / "nope.pem"), "--https-key", key],
            f"--https-cert (BITDELTA_GATEWAY_HTTPS_CERT) {tmp / 'nope.pem'}: no such file",
        ),
        "cert not PEM": (
            ["--https-cert", str(tmp / "garbage.pem"), "--https-key", key],
            f"--https-cert (BITDELTA_GATEWAY_HTTPS_CERT) {tmp / 'garbage.pem'}: not a PEM certificate",
        ),
        "key not PEM": (
            ["--https-cert", cert, "--https-key", str(tmp / "garbage.pem")],
            f"--https-key (BITDELTA_GATEWAY_HTTPS_KEY) {tmp / 'garbage.pem'}: not the PEM private key",
        ),
        "key of another certificate": (
            ["--https-cert", cert, "--https-key", str(certs / "client.key")],
            "--https-key (BITDELTA_GATEWAY_HTTPS_KEY) "
            f"{certs / 'client.key'}: not the "
            "PEM private key of --https-cert (BITDELTA_GATEWAY_HTTPS_CERT) "
            "(X509: KEY_VALUES_MISMATCH)",
        ),
        "client CA not PEM": (
            ["--https-cert", cert, "--https-key", key, "--https-client-ca", str(tmp / "garbage.pem")],
            f"--https-client-ca (BITDELTA_GATEWAY_HTTPS_CLIENT_CA) {tmp / 'garbage.pem'}: not a PEM CA bundle",
        ),
    }


def test_bad_https_flags_stop_the_process_with_exit_2_naming_the_flag(certs, tmp_path):
    """Each a real `python -m services.gateway` start (run side by side): exit 2, one line naming the
    flag, no traceback. (The control, good files starting a serving gateway, is the `cluster` fixture.)"""
    cases = bad_flag_cases(certs, tmp_path)
    base = [sys.executable, "-m", "services.gateway", "--router", "127.0.0.1:1", "--log-level", "WARNING"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BITDELTA_GATEWAY_")} | {"OMP_NUM_THREADS": "1"}

    def run(flags):
        return subprocess.run(
            [*base, "--address", f"127.0.0.1:{free_port()}", *flags],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=T,
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = dict(zip(cases, pool.map(run, [flags for flags, _ in cases.values()])))
    for name, (_, words) in cases.items():
        r = done[name]
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert r.stderr.startswith("services.gateway: bad configuration: ") and words in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)


# -- Kubernetes ----------------------------------------------------------------------------------------------
def test_k8s_gateway_serves_https_from_its_secret_and_probes_it(tmp_path):
    """The gateway's container reads its HTTPS certificate and key from Secret bitdelta-tls-gateway (what
    `python -m bitdelta.rpc.certs --k8s-secrets` writes), its config accepts them (with that script's
    gateway certificate), its probes speak HTTPS, and the Service forwards to that port."""
    import yaml

    from bitdelta.rpc.certs import k8s_secrets
    from tests.support.deploy import k8s_objects

    make_all(tmp_path, ["gateway"])
    secret = next(d for d in yaml.safe_load_all(k8s_secrets(tmp_path, ["gateway"])))
    objs = k8s_objects()
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "gateway")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert secrets[mounts["/etc/bitdelta/tls"]] == secret["metadata"]["name"] == "bitdelta-tls-gateway"
    env = {e["name"]: e["value"] for e in c["env"]}
    files = {
        f"/etc/bitdelta/tls/{k}": tmp_path / v
        for k, v in {"ca.pem": "ca.pem", "tls.pem": "gateway.pem", "tls.key": "gateway.key"}.items()
    }
    assert {env["BITDELTA_GATEWAY_HTTPS_CERT"], env["BITDELTA_GATEWAY_HTTPS_KEY"]} <= set(files)
    assert {Path(p).name for p in (env["BITDELTA_GATEWAY_HTTPS_CERT"], env["BITDELTA_GATEWAY_HTTPS_KEY"])} <= set(
        secret["data"]
    )
    config = GatewayConfig.from_args(
        [str(tmp_path) if prev == "--chat-template" else a for prev, a in zip(["", *c["args"]], c["args"])],
        env={k: str(files.get(v, v)) for k, v in env.items()},
    )
    assert config.https_on and config.https_client_ca is None and config.tls_on
    port = config.host_port[1]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["https"] == port and "http" not in ports
    ready = c["readinessProbe"]["httpGet"]
    assert ready["scheme"] == "HTTPS" and ready["port"] in ("https", port)
    live = c["livenessProbe"]  # a TCP connect, or an HTTPS GET
    assert live["tcpSocket"]["port"] == "https" if "tcpSocket" in live else live["httpGet"]["scheme"] == "HTTPS"
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "gateway")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["https"]
