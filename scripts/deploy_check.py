"""The checks of scripts/deploy-test.sh, on the images it built and the compose stack it runs.

    deploy_check.py images --out DIR      what each image holds (user, torch, compiler, protoc), sizes,
                                          and the Kubernetes manifests' commands against the entry points
    deploy_check.py family                the family to serve, as shell assignments (BITDELTA_BASE_DIR=...)
    deploy_check.py compose --project NAME --out FILE
                                          the compose file the stack runs from (both files merged)
    deploy_check.py stack --out DIR --project NAME --base DIR --deltas DIR
                                          every container healthy on the host's network; the same greedy
                                          text through the gateway (openai SDK) and the router (`bitdelta
                                          generate`) as from the same files served without containers;
                                          the worker reads the store's shared memory; one trace per request
                                          with its TTFT spans at the collector; Prometheus's targets up

Each writes what it found into DIR/report.json (merged) and exits non-zero on the first failure.
The ports are deploy/local/docker-compose.local.yml's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import redirect_stdout
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo import PROMPTS  # noqa: E402  (the demo's requests)

from bitdelta import traces  # noqa: E402
from bitdelta.rpc.clients.router import RouterClient  # noqa: E402
from bitdelta.rpc.clients.worker import WorkerClient  # noqa: E402
from bitdelta.testing.cluster import Cluster  # noqa: E402

ROUTER, GATEWAY, PROMETHEUS, SINK = "127.0.0.1:25051", "127.0.0.1:25080", "127.0.0.1:25090", "127.0.0.1:25319"
WORKER = "127.0.0.1:25061"  # the CPU worker of deploy/local/docker-compose.local.yml
SERVICES = ("delta-store", "worker", "router", "gateway", "otel-collector", "prometheus")
# image -> (the service module its entry point runs or None, whether torch belongs in it, whether a C compiler does)
IMAGES = {
    "bitdelta/router:latest": ("services.router", False, False),
    "bitdelta/gateway:latest": ("services.gateway", False, False),
    "bitdelta/delta-store:latest": ("services.delta_store", True, False),
    "bitdelta/worker:cpu": ("services.gpu_worker", True, False),  # its C kernels are built in the build stage
    "bitdelta/rotel:local": (None, False, False),
    "bitdelta/prometheus:local": (None, False, False),
}
MAX_NEW = 24


def fail(msg: str) -> None:
    raise SystemExit(f"[deploy-check] FAILED: {msg}")


def say(msg: str) -> None:
    print(f"[deploy-check] {msg}", flush=True)


def docker(*args: str, check: bool = True) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        fail(f"docker {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def report(out: Path, **parts) -> None:
    path = out / "report.json"
    have = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**have, **parts}, indent=2) + "\n")


# -- images -------------------------------------------------------------------------------------------
def in_image(image: str, code: str) -> str:
    """Run Python `code` in `image` (no network) and return what it printed."""
    return docker("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", code).strip()


PROBE = (
    "import importlib.util as u, shutil, json; "
    "print(json.dumps({m: u.find_spec(m) is not None for m in ('torch', 'grpc_tools')} | "
    "{'compiler': bool(shutil.which('gcc') or shutil.which('cc'))}))"
)


def check_images(out: Path) -> None:
    found = {}
    for image, (module, torch_ok, cc_ok) in IMAGES.items():
        cfg = json.loads(docker("image", "inspect", image))[0]
        c = cfg["Config"]
        has = json.loads(in_image(image, PROBE))
        found[image] = {
            "size_mb": round(cfg["Size"] / 1e6),
            "user": c.get("User"),
            "entrypoint": c.get("Entrypoint"),
            "healthcheck": bool(c.get("Healthcheck")),
            **has,
        }
        if c.get("User") != "10001":
            fail(f"{image} runs as {c.get('User') or 'root'}, not uid 10001")
        if not c.get("Healthcheck"):
            fail(f"{image} has no HEALTHCHECK")
        if has["torch"] and not torch_ok:
            fail(f"{image} carries torch")
        if has["grpc_tools"]:
            fail(f"{image} carries grpcio-tools (a build tool: it belongs in the build stage)")
        if has["compiler"] and not cc_ok:
            fail(f"{image} carries a C compiler")
        if module and c.get("Entrypoint") != ["python", "-m", module]:
            fail(f"{image}: entry point {c.get('Entrypoint')}, want python -m {module}")
    check_manifests(found)
    for image, f in found.items():
        say(f"{image:28s} {f['size_mb']:6d} MB  user {f['user']}  torch {f['torch']}  compiler {f['compiler']}")
    report(out, images=found)


def check_manifests(found: dict) -> None:
    """The `kubectl apply --dry-run=client` a cluster-less machine can do for the commands: every
    container of deploy/k8s that runs one of these images runs the image's own entry point (no
    `command` override, or the same one), with the arguments tests/deploy parse by the service's config."""
    for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for obj in yaml.safe_load_all(f.read_text()):
            if not obj or obj["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for c in obj["spec"]["template"]["spec"]["containers"]:
                entry = found.get(c["image"], {}).get("entrypoint") or (
                    found["bitdelta/worker:cpu"]["entrypoint"] if c["image"] == "bitdelta/worker:cuda" else None
                )
                if entry is None:
                    continue  # not ours (jaeger)
                if c.get("command") not in (None, entry):
                    fail(f"{f.name} {c['name']}: command {c['command']} is not the image's entry point {entry}")
                if not c.get("args") or not c["args"][0].startswith("--"):
                    fail(f"{f.name} {c['name']}: args {c.get('args')} do not start with a flag for {entry}")


# -- the compose file ---------------------------------------------------------------------------------
def compose_file(project: str, out: Path) -> None:
    """deploy/docker-compose.yml merged with deploy/local/docker-compose.local.yml (`docker-compose
    config`), less the published ports: a container on the host's network publishes nothing, and
    docker-compose refuses the two together, while an override file can add to a list but not empty it."""
    files = ["-f", "deploy/docker-compose.yml", "-f", "deploy/local/docker-compose.local.yml"]
    r = subprocess.run(["docker-compose", "-p", project, *files, "config"], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        fail(f"docker-compose config: {r.stderr.strip()}")
    merged = yaml.safe_load(r.stdout)
    for name, svc in merged["services"].items():
        if svc.get("network_mode") != "host":
            fail(f"{name} is not on the host's network (deploy/local/docker-compose.local.yml)")
        svc.pop("ports", None)
    out.write_text(yaml.safe_dump(merged, sort_keys=False))


# -- the family -----------------------------------------------------------------------------------------
def family() -> None:
    from bitdelta import family as fam
    from bitdelta.family import build as fb
    from bitdelta.testing.real import real_deltas_of  # what the tests serve when data/ has no family

    with redirect_stdout(sys.stderr):  # stdout is the assignments alone
        base = fb.build_base(fam.paths())
        dirs = {d.parent for d in real_deltas_of(base).values()}
    if len(dirs) != 1:
        fail(f"the deltas lie in {len(dirs)} directories; the store serves one")
    print(f"BITDELTA_BASE_DIR={shlex.quote(str(base))}\nBITDELTA_DELTAS_DIR={shlex.quote(str(dirs.pop()))}")


# -- the stack ------------------------------------------------------------------------------------------
def containers(project: str) -> dict[str, dict]:
    ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}").split()
    info = json.loads(docker("inspect", *ids)) if ids else []
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in info}


def wait_healthy(project: str, timeout: float = 300) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        cs = containers(project)
        health = {s: cs[s]["State"].get("Health", {}).get("Status", "none") if s in cs else "absent" for s in SERVICES}
        if all(h == "healthy" for h in health.values()):
            return cs
        for s, c in cs.items():
            if c["State"]["Status"] in ("exited", "dead") or c["RestartCount"]:
                fail(f"{s} stopped (exit {c['State']['ExitCode']}): docker logs {c['Name'].lstrip('/')}")
        if time.monotonic() > deadline:
            fail(f"not every service turned healthy in {timeout:.0f} s: {health}")
        time.sleep(2)


async def served_without_containers(base: Path, deltas: Path, models: list[str], logs: Path) -> dict[str, str]:
    """The same files served by the same services as host processes (bitdelta.testing's Cluster,
    the compiled CPU kernels as in the worker image), with this machine's own CPU precision as in the
    containers (not a caller's test setting): the reference greedy text for each model."""
    with Cluster(logs / "reference", env={"BITDELTA_CPU_PRECISION": "auto"}) as c:
        store = c.store(deltas)
        worker = c.worker(base, store.address, delta_budget="1GiB", kv_cache="512MiB")
        router = c.router([worker.address], store.address)
        c.wait_serving(store, worker, router)
        async with RouterClient(router.address, generate_timeout_s=300) as r:
            await wait_models(r, models)
            return {m: await generate(r, m) for m in models}


async def wait_models(r: RouterClient, models: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = {m.model_id for m in await r.list_models() if m.servable}
        if all(w.up for w in await r.list_workers()) and set(models) - {""} <= listed:
            return
        if time.monotonic() > deadline:
            fail(f"the router never listed {models} as servable (has {sorted(listed)})")
        await asyncio.sleep(0.5)


async def generate(r: RouterClient, model: str) -> str:
    stream = r.generate(model, PROMPTS.get(model, PROMPTS[""]), max_new_tokens=MAX_NEW)
    return "".join([t.text async for m in stream for t in m.tokens])


def cli_generate(model: str) -> str:
    """`bitdelta generate` against the router container: prints the prompt, then the answer."""
    prompt = PROMPTS.get(model, PROMPTS[""])
    r = subprocess.run(
        [sys.executable, "-m", "bitdelta.cli", "generate", "--router", ROUTER, "--model", model,
         "--max-new-tokens", str(MAX_NEW), prompt],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    if r.returncode != 0 or not r.stdout.startswith(prompt):
        fail(f"bitdelta generate --model {model!r}: exit {r.returncode}: {r.stderr.strip()[-500:]}")
    return r.stdout[len(prompt) :].removesuffix("\n")


def sdk_generate(model_ids: dict[str, str]) -> dict[str, str]:
    """The openai SDK against the gateway container, greedy (temperature 0)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{GATEWAY}/v1", api_key="unused", timeout=600)
    listed = {m.id for m in client.models.list().data}
    if set(model_ids.values()) - listed:
        fail(f"the gateway lists {sorted(listed)}, not {sorted(model_ids.values())}")
    return {
        m: client.completions.create(model=mid, prompt=PROMPTS.get(m, PROMPTS[""]), max_tokens=MAX_NEW, temperature=0)
        .choices[0]
        .text
        for m, mid in model_ids.items()
    }


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def wait_targets_up(timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        targets = get_json(f"http://{PROMETHEUS}/api/v1/targets")["data"]["activeTargets"]
        if targets and all(t["health"] == "up" for t in targets):
            return [{"job": t["labels"]["job"], "url": t["scrapeUrl"], "health": t["health"]} for t in targets]
        if time.monotonic() > deadline:
            fail(f"Prometheus targets not all up: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}")
        time.sleep(1)


def transports() -> dict[str, float]:
    """The store's Fetch calls by transport, as Prometheus scraped them from its /metrics."""
    q = urllib.parse.quote("bitdelta_delta_store_fetch_transports_total")
    result = get_json(f"http://{PROMETHEUS}/api/v1/query?query={q}")["data"]["result"]
    return {r["metric"]["transport"]: float(r["value"][1]) for r in result}


def wait_traces(path: Path, n: int, timeout: float = 60) -> dict:
    """Each router.Generate trace at the sink, once `n` of them carry the worker's TTFT spans."""
    want = {"router.Generate", "worker.Generate", "worker.schedule", "worker.prefill"}
    deadline = time.monotonic() + timeout
    while True:
        spans = traces.read_file(path) if path.exists() else []
        by_trace: dict[str, list[traces.Span]] = {}
        for s in spans:
            by_trace.setdefault(s.trace_id, []).append(s)
        complete = [t for t in by_trace.values() if want <= {s.name for s in t}]
        if len(complete) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    roots = [s for s in spans if s.name == "router.Generate"]
    if len(roots) != n or len(complete) != n or len({s.trace_id for s in roots}) != n:
        fail(f"the collector passed on {len(roots)} router.Generate spans, {len(complete)} complete traces; want {n}")
    rows = traces.ttft_rows(spans)
    fetch = [s.attrs.get("fetch.transport") for s in spans if s.name == "delta_store.fetch"]
    return {"ttft": rows, "fetch_transports": fetch, "spans": len(spans)}


def worker_kernels(container: str) -> str:
    """The C kernel library the worker container loaded (its log's line), which must be a prebuilt
    one: the image has no compiler, so the torch fallback would mean the prebuilt libraries failed."""
    r = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if "kernels: C CPU kernels" in line]
    loaded = [line.split("kernels: C CPU kernels loaded ", 1)[1] for line in lines if " loaded " in line]
    if not loaded or "/opt/bitdelta-kernels/" not in loaded[0]:
        fail(f"the worker did not load its prebuilt C kernels: {lines or 'no kernels line in its log'}")
    return loaded[0]


async def check_stack(a: argparse.Namespace) -> None:
    out = a.out
    sink = traces.OtlpFileSink(out / "spans.jsonl", SINK)
    try:
        cs = wait_healthy(a.project)
        nets = {s: c["HostConfig"]["NetworkMode"] for s, c in cs.items()}
        if any(n != "host" for n in nets.values()):
            fail(f"containers off the host's network: {nets}")
        say(f"healthy on the host's network: {', '.join(sorted(cs))}")
        variants = sorted(f.name.split(".")[0] for f in a.deltas.glob("*.bitdelta.safetensors"))[:2]
        models = ["", *variants]
        async with RouterClient(ROUTER, generate_timeout_s=300) as r:
            await wait_models(r, models)
            base_id = next(m.model_id for m in await r.list_models() if m.is_base)
        cli = {m: cli_generate(m) for m in models}
        sdk = sdk_generate({m: m or base_id for m in models})
        say("the same requests against the same files without containers")
        ref = await served_without_containers(a.base, a.deltas, models, out)
        texts = {m or "base": {"reference": ref[m], "bitdelta generate": cli[m], "openai SDK": sdk[m]} for m in models}
        for m, t in texts.items():
            say(f"{m}: {t['reference']!r}")
            if len(set(t.values())) != 1:
                fail(f"{m}: the texts differ: {t}")
        seen = wait_traces(out / "spans.jsonl", n=2 * len(models))
        targets = wait_targets_up()
        tr = transports()
        if tr.get("shared-memory", 0) < len(variants) or tr.get("stream", 0):
            fail(f"the worker did not read every delta from the store's shared memory: Fetch transports {tr}")
        if set(seen["fetch_transports"]) != {"shared-memory"}:
            fail(f"delta_store.fetch spans' transports: {seen['fetch_transports']}")
        async with WorkerClient(WORKER) as w:  # the worker's own word: how each resident delta arrived
            slots = {s.name: s.transport for s in (await w.status()).slots if s.name in variants}
        if slots != dict.fromkeys(variants, "shared-memory"):
            fail(f"the worker's Status does not say every delta came through shared memory: {slots}")
        kernels = worker_kernels(cs["worker"]["Name"].lstrip("/"))
        say(f"{2 * len(models)} requests, {2 * len(models)} traces with TTFT spans; Fetch transports {tr}")
        say(f"the worker's CPU kernels: {kernels}")
        say(f"Prometheus targets up: {', '.join(t['job'] for t in targets)}")
        report(
            out,
            network_modes=nets,
            health={s: c["State"]["Health"]["Status"] for s, c in cs.items()},
            texts=texts,
            traces={"requests": 2 * len(models), **seen},
            fetch_transports=tr,
            worker_slot_transports=slots,
            worker_cpu_kernels=kernels,
            prometheus_targets=targets,
        )
    finally:
        sink.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("images")
    p.add_argument("--out", type=Path, required=True)
    sub.add_parser("family")
    p = sub.add_parser("compose")
    p.add_argument("--project", required=True)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("stack")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--deltas", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "images":
        check_images(a.out)
    elif a.cmd == "family":
        family()
    elif a.cmd == "compose":
        compose_file(a.project, a.out)
    else:
        asyncio.run(check_stack(a))


if __name__ == "__main__":
    main()
