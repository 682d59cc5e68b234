"""deploy/: the compose file and the Kubernetes manifests validate without a daemon or a cluster, and
every command line in them is one the services accept (parsed by each service's own typed config,
so a renamed or misspelt flag fails here), and the images' pins agree with pyproject.toml.

    docker-compose -f deploy/docker-compose.yml config -q      (Debian `docker-compose`, scripts/compose.sh)
    kubernetes-validate --strict deploy/k8s/*.yaml             (PyPI, dev extra)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.deploy import (
    COMPOSE,
    DEPLOY,
    MANIFESTS,
    MANIFESTS_70B,
    ROOT,
    config_class,
    entrypoint_module,
    image_modules,
    k8s_objects,
)

DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def compose_bin() -> str:
    """docker-compose, installed from Debian by scripts/compose.sh when missing (as root)."""
    if shutil.which("docker-compose") is None:
        subprocess.run(["bash", str(ROOT / "scripts" / "compose.sh"), "install"], check=True)
    exe = shutil.which("docker-compose")
    assert exe, "scripts/compose.sh did not install docker-compose"
    return exe


def parse_with_config(module: str, argv: list[str], tmp: Path) -> object:
    """`argv` through the service's config, with paths rewritten to test directories that exist
    (the worker checks its base holds config.json and tokenizer.json; the store its root)."""
    base = tmp / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text("{}")
    (base / "tokenizer.json").write_text("{}")
    fixed = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev in ("--base", "--chat-template"):
            a = str(base)
        elif prev == "--root":
            a = str(tmp)
        fixed.append(a)
    return config_class(module).from_args(fixed, env={})


# -- docker-compose ------------------------------------------------------------------------------------
def test_compose_file_is_valid():
    for profile in ([], ["--profile", "cuda"], ["--profile", "seed"]):
        r = subprocess.run(
            [compose_bin(), "-f", str(COMPOSE), *profile, "config", "-q"], capture_output=True, text=True, cwd=ROOT
        )
        assert r.returncode == 0, r.stderr


def test_compose_command_lines_are_the_services_real_flags(tmp_path):
    r = subprocess.run(
        [compose_bin(), "-f", str(COMPOSE), "--profile", "cuda", "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    resolved = yaml.safe_load(r.stdout)["services"]
    modules = image_modules()
    checked = set()
    for name, svc in resolved.items():
        module = modules.get(svc.get("image"))
        if module is None or "entrypoint" in svc:
            continue
        config = parse_with_config(module, list(svc["command"]), tmp_path)
        checked.add(name)
        if module != "services.gateway":
            assert config.metrics_address.endswith(":9400"), f"{name}: Prometheus scrapes :9400"
            assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert {"router", "delta-store", "worker", "worker-cuda", "gateway"} <= checked
    assert resolved["worker-cuda"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_prometheus_scrapes_every_service():
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("router", "delta-store", "worker", "worker-cuda"):
        assert f"{name}:9400" in targets and name in compose


# -- Kubernetes -----------------------------------------------------------------------------------------
def test_manifests_validate_strictly():
    exe = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(exe), "--strict", "--no-warn", *map(str, MANIFESTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") >= 15


def test_k8s_containers_use_real_flags_grpc_probes_and_limits(tmp_path):
    modules = image_modules() | {"bitdelta/worker:cuda": "services.gpu_worker"}
    seen = set()
    for obj in k8s_objects():
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            module = modules.get(c["image"])
            if module is None:
                continue  # jaeger
            seen.add(module)
            parse_with_config(module, c["args"], tmp_path)
            res = c["resources"]
            assert res["requests"] and res["limits"], c["name"]
            if module != "services.gateway":
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                port = ports.get("health", ports["grpc"])  # mTLS on: the plain-text --health-address port
                assert c["readinessProbe"]["grpc"]["port"] == port and c["livenessProbe"]["grpc"]["port"] == port
                if module != "services.router":  # NOT_SERVING while loading the base / listing the backend
                    assert c["startupProbe"]["grpc"]["port"] == port, c["name"]
            if module == "services.gpu_worker":
                assert res["limits"]["nvidia.com/gpu"] == "1"
    assert seen == {"services.router", "services.delta_store", "services.gpu_worker", "services.gateway"}


def test_router_lists_every_worker_pod_of_the_statefulset():
    objs = k8s_objects()
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    workers = args[args.index("--workers") + 1].split(",")
    ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
    want = [
        f"{name}-{i}.{svc['metadata']['name']}.{ns}.svc.cluster.local:50061" for i in range(sts["spec"]["replicas"])
    ]
    assert workers == want
    assert {o["kind"] for o in objs} >= {"ConfigMap", "PersistentVolumeClaim", "PodDisruptionBudget", "Namespace"}


def test_the_70b_plan_manifests_match_bitdelta_plan(tmp_path):
    """deploy/k8s-70b/: one worker over 8 GPUs as 8 tensor-parallel ranks, its per-rank delta budget
    and KV cache what `bitdelta plan --tensor-parallel 8` gives Llama-2-70B x 14 on 8 x 80 GB."""
    import json

    from bitdelta import plan

    exe = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(exe), "--strict", "--no-warn", *map(str, MANIFESTS_70B)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("passed") >= 7, r.stdout + r.stderr
    objs = k8s_objects(MANIFESTS_70B)
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    cfg = parse_with_config("services.gpu_worker", c["args"], tmp_path)
    p = plan.make_plan(
        json.loads((ROOT / "configs" / "llama-2-70b.json").read_text()), variants=14, gpu_mem=80e9, gpus=8
    )
    assert cfg.tensor_parallel == p.tp == 8 and sts["spec"]["replicas"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert 14 * p.delta_per_gpu <= cfg.delta_budget < 15 * p.delta_per_gpu  # 14 shards per rank, not 15
    assert 0.95 * p.free_for_kv_per_gpu <= cfg.kv_cache <= p.free_for_kv_per_gpu
    used = p.base_per_gpu + cfg.delta_budget + cfg.kv_cache + p.reserve
    assert used <= 80e9
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--workers") + 1] == "gpu-worker-0.gpu-worker.bitdelta.svc.cluster.local:50061"


def test_a_wrong_flag_would_fail(tmp_path):
    """The negative control: the check above rejects a flag the service does not have."""
    with pytest.raises(SystemExit):
        parse_with_config(
            "services.router", ["--workers", "a:1", "--delta-store", "b:2", "--metrics-adress", "x:1"], tmp_path
        )


# -- images ---------------------------------------------------------------------------------------------
def test_images_are_small_non_root_and_health_checked():
    for f in DOCKERFILES:
        text = f.read_text()
        assert re.search(r"^USER 10001$", text, re.M), f"{f.name} runs as root"
        assert "HEALTHCHECK" in text, f.name
        entrypoint_module(f)
    router = (DEPLOY / "docker" / "router.Dockerfile").read_text()
    assert not [line for line in router.splitlines() if "pip install" in line and "torch" in line], (
        "the router carries no torch"
    )
    assert "torch" not in (DEPLOY / "docker" / "requirements-rpc.txt").read_text()
    cuda = (DEPLOY / "docker" / "gpu_worker-cuda.Dockerfile").read_text()
    assert re.search(r"^FROM pytorch/pytorch:[\w.-]*cuda", cuda, re.M)


def test_image_pins_agree_with_pyproject():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {re.split(r"[=<>!~ ]", d)[0].lower(): d for d in deps}
    for line in (DEPLOY / "docker" / "requirements-rpc.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name = re.split(r"[=<>!~ ]", line)[0].lower()
            assert pins.get(name) == line, f"requirements-rpc.txt {line!r} vs pyproject {pins.get(name)!r}"
