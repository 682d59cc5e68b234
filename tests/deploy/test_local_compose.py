"""deploy/local/: the compose override scripts/deploy-test.sh runs the stack with, without a daemon.
Every service is on the host's network and listens on its own loopback port (so no container talks to
any address but 127.0.0.1), health checks and Prometheus look where the services listen, and the
images' build stages keep what the runtime does not need."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

from tests.support.deploy import image_modules, k8s_objects

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
LOCAL = yaml.safe_load((DEPLOY / "local" / "docker-compose.local.yml").read_text())["services"]
SERVICE_DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
LOCAL_DOCKERFILES = sorted((DEPLOY / "local").glob("*.Dockerfile"))


def addresses(command: list[str]) -> dict[str, str]:
    """flag -> value for every flag whose value is an address (host:port or a URL); `--flag=value` too."""
    argv = [part for a in command for part in (a.split("=", 1) if a.startswith("--") else [a])]
    return {f: v for f, v in zip(argv, argv[1:]) if f.startswith("--") and re.search(r":\d+$", v)}


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_every_service_is_on_the_hosts_network():
    assert set(BASE) <= set(LOCAL), f"services without an override: {set(BASE) - set(LOCAL)}"
    for name, svc in LOCAL.items():
        assert svc.get("network_mode") == "host", f"{name} is not on the host's network"


def test_every_address_is_loopback_and_every_port_its_own():
    seen: dict[int, str] = {}
    for name, svc in LOCAL.items():
        env = {**BASE.get(name, {}).get("environment", {}), **svc.get("environment", {})}
        for flag, value in [
            *addresses(svc.get("command", [])).items(),
            *[(k, v) for k, v in env.items() if "://" in v],
        ]:
            host = re.sub(r"^\w+://", "", value).rsplit(":", 1)[0]
            assert host == "127.0.0.1", f"{name} {flag} {value}: not loopback"
            if flag.endswith(("address", "endpoint")) and "exporter" not in flag and not flag.startswith("OTEL"):
                assert port(value) not in seen, f"{name} {flag}: port {port(value)} also {seen.get(port(value))}'s"
                seen[port(value)] = name
    assert {"delta-store", "worker", "router", "gateway", "otel-collector", "prometheus"} <= set(seen.values())


def test_health_checks_and_prometheus_look_where_the_services_listen():
    for name, svc in LOCAL.items():
        cmd = svc.get("command")
        if not cmd or "profiles" in svc:
            continue
        have = addresses(cmd)
        listen = next(have[f] for f in ("--address", "--otlp-grpc-endpoint", "--web.listen-address") if f in have)
        assert svc["environment"]["PORT"] == str(port(listen)), f"{name}: its HEALTHCHECK asks 127.0.0.1:$PORT"
    prom = yaml.safe_load((DEPLOY / "local" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    metrics = {addresses(LOCAL[s]["command"])["--metrics-address"] for s in ("delta-store", "worker", "router")}
    assert targets == metrics
    assert (
        LOCAL["worker"]["command"][LOCAL["worker"]["command"].index("--delta-store") + 1]
        == addresses(LOCAL["delta-store"]["command"])["--address"]
    )


def test_the_stack_keeps_the_users_volumes_and_the_shared_memory_cache():
    """The override changes networks, addresses and the two registry images, nothing else of the stack."""
    for name in ("delta-store", "worker", "router", "gateway"):
        assert set(LOCAL[name]) <= {"network_mode", "command", "environment"}, name
        assert "/delta-cache" in " ".join(BASE[name].get("volumes", [])) or name in ("router", "gateway")
    assert "--shared-memory-dir" in LOCAL["delta-store"]["command"]
    assert LOCAL["jaeger"]["profiles"] and LOCAL["otel-collector"]["image"] == "bitdelta/rotel:local"


def test_images_build_on_any_base_and_keep_build_tools_in_the_build_stage():
    for f in SERVICE_DOCKERFILES + LOCAL_DOCKERFILES:
        text = f.read_text()
        if f.name == "gpu_worker-cuda.Dockerfile":
            continue  # on the official PyTorch CUDA image (torch and CUDA inside), not built here
        assert text.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}" in text, f.name
        stages = re.split(r"^FROM ", text, flags=re.M)[1:]
        runtime = stages[-1]
        assert "pip install" not in runtime and "grpcio-tools" not in runtime, f"{f.name}: pip in the runtime stage"
        assert re.search(r"^USER 10001$", runtime, re.M) and "HEALTHCHECK" in runtime, f.name
        if f in SERVICE_DOCKERFILES:
            assert "protos_build --force" in text, f"{f.name}: a stamp copied into the context would skip protoc"
    assert "bitdelta/.protos-stamp" in (ROOT / ".dockerignore").read_text().split()


def test_build_pins_agree_with_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {re.split(r"[=<>!~ ]", d)[0].lower(): d for d in deps}
    lines = [ln for ln in (DEPLOY / "docker" / "requirements-build.txt").read_text().splitlines() if ln[:1].isalpha()]
    assert lines == [pins["grpcio-tools"]]
    rotel = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
        if d.startswith("rotel")
    )
    assert f'"{rotel}"' in (DEPLOY / "local" / "rotel.Dockerfile").read_text()


def test_kubernetes_runs_the_images_entry_points():
    """What `kubectl apply --dry-run=client` would let through unnoticed: a manifest that overrides an
    image's ENTRYPOINT (`command`) runs something else than the compose run proved; the manifests pass
    only arguments, which tests/deploy/test_deploy.py parses with the services' configs."""
    modules = image_modules() | {"bitdelta/worker:cuda": "services.gpu_worker"}
    checked = set()
    for obj in k8s_objects():
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            if c["image"] in modules:
                name = f"{obj['metadata']['name']}/{c['name']}"
                assert c.get("command") in (None, ["python", "-m", modules[c["image"]]]), f"{name} overrides it"
                assert c["args"][0].startswith("--"), name
                checked.add(modules[c["image"]])
    assert checked == {"services.router", "services.delta_store", "services.gpu_worker", "services.gateway"}
