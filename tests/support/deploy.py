"""The deployment files as data, for the tests that check them (tests/deploy/, and the TLS checks of
the manifests in tests/rpc/test_security.py and tests/gateway/test_gateway_https.py): the
Kubernetes objects, each image's service module, each service module's typed config."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
MANIFESTS_70B = sorted((DEPLOY / "k8s-70b").glob("*.yaml"))  # the 70B x 14 plan's worker and router


def config_class(module: str):
    """The typed config of `python -m <module>`."""
    if module == "services.router":
        from services.router.config import RouterConfig

        return RouterConfig
    if module == "services.delta_store":
        from services.delta_store.config import Config

        return Config
    if module == "services.gpu_worker":
        from services.gpu_worker.config import WorkerConfig

        return WorkerConfig
    if module == "services.gateway":
        from services.gateway.config import GatewayConfig

        return GatewayConfig
    raise AssertionError(f"unknown service module {module}")


def entrypoint_module(dockerfile: Path) -> str:
    m = re.search(r'^ENTRYPOINT \["python", "-m", "([\w.]+)"\]', dockerfile.read_text(), re.M)
    assert m, f"{dockerfile.name}: no ENTRYPOINT python -m MODULE"
    return m.group(1)


def image_modules() -> dict[str, str]:
    """image name (as compose and k8s refer to it) -> the service module its ENTRYPOINT runs."""
    compose = yaml.safe_load(COMPOSE.read_text())
    out = {}
    for svc in compose["services"].values():
        b = svc.get("build")
        if b:
            out[svc["image"]] = entrypoint_module(ROOT / b["dockerfile"])
    return out


def k8s_objects(manifests: list[Path] = MANIFESTS) -> list[dict]:
    return [d for f in manifests for d in yaml.safe_load_all(f.read_text()) if d]
