"""The main job, end to end on one machine: serve the real model family through the router.

Starts, as separate processes on loopback ports, the delta store (local backend over
data/deltas), TWO workers each holding the SmolLM2-135M base once, the router in front of
them and the OpenAI-compatible gateway in front of the router; then sends real requests
through the router's public `Generate`:

1. one request to the base and to every variant at once (all cold: each variant's delta is
   streamed from the store into a worker's slot on first use),
2. three requests per variant at once (warm: requests for one variant share one worker and batch
   together with the others),
3. one request to a variant evicted just before (cold again: its TTFT shows the delta load),

and prints each answer with the worker that served it and its time-to-first-token breakdown,
then the models and workers the router reports and a `grpcurl` line to try; then one call to
the gateway as curl would send it and the `openai` SDK streaming from a variant; and stops
everything with SIGTERM (each service drains).

    .venv/bin/python scripts/demo.py [--max-new-tokens 40] [--keep-running]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bitdelta.common.v1 import generation_pb2 as gen_pb  # noqa: E402
from bitdelta.router.v1 import router_pb2 as pb  # noqa: E402
from bitdelta.rpc.clients.router import RouterCallError, RouterClient  # noqa: E402
from bitdelta.rpc.clients.worker import WorkerClient  # noqa: E402
from bitdelta.testing.cluster import free_port  # noqa: E402

PROMPTS = {
    "": "The capital of France is",
    "coder": "def fibonacci(n):\n",
    "writer": "ROMEO. ",
    "scripture": "Genesis 1:1 In the beginning",
    "math": "Question: What is 417 + 385?\nAnswer:",
}
ARRIVAL = {
    pb.ARRIVAL_STATE_UNSPECIFIED: "base",
    pb.ARRIVAL_STATE_RESIDENT: "resident",
    pb.ARRIVAL_STATE_LOADING: "loading",
    pb.ARRIVAL_STATE_COLD: "cold",
}


async def wait_serving(addr: str, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    import grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited with code {proc.returncode}; see its log in .tmp/demo-logs/")
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.3)
    raise SystemExit(f"{what} did not become healthy within {timeout:.0f} s")


async def one_request(router: RouterClient, model: str, max_new: int) -> dict:
    t0 = time.perf_counter()
    first, text, n, last = None, [], 0, None
    async for m in router.generate(
        model, PROMPTS.get(model, PROMPTS[""]), max_new_tokens=max_new, request_id=f"demo-{model or 'base'}"
    ):
        if first is None:
            first = m  # the first message: worker, arrival state, TTFT
        text.extend(t.text for t in m.tokens)  # every token the router had ready when it wrote the message
        n += len(m.tokens)
        last = m.tokens[-1]
    return {
        "model": model or "base",
        "first": first,
        "text": "".join(text),
        "n": n,
        "last": last,
        "wall_ms": (time.perf_counter() - t0) * 1e3,
    }


def show(r: dict, with_text: bool = True) -> None:
    f, t = r["first"], r["first"].ttft
    reason = gen_pb.FinishReason.Name(r["last"].finish_reason).removeprefix("FINISH_REASON_").lower()
    print(
        f"--- {r['model']:9s} on {f.worker:15s} {ARRIVAL[f.arrival_state]:8s} ttft {t.total_ms:7.1f} ms = "
        f"queue {t.queue_ms:5.1f} + delta load {t.delta_load_ms:6.1f} + schedule {t.schedule_ms:5.1f} + "
        f"prefill {t.prefill_ms:6.1f} + hops {t.total_ms - t.queue_ms - t.delta_load_ms - t.schedule_ms - t.prefill_ms:5.1f}"
        f"   {r['n']} tokens ({reason}) in {r['wall_ms']:.0f} ms"
    )
    if with_text:
        prompt = PROMPTS["" if r["model"] == "base" else r["model"]]
        print("    " + (prompt + r["text"]).replace("\n", "\n    ") + "\n")


async def demo(router_addr: str, worker_addrs: list[str], variants: list[str], max_new: int) -> None:
    async with RouterClient(router_addr) as router:
        deadline = time.monotonic() + 60
        while not all(w.up for w in await router.list_workers()):
            if time.monotonic() > deadline:
                raise SystemExit("the router does not see both workers up; see .tmp/demo-logs/")
            await asyncio.sleep(0.2)
        models = ["", *variants]

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_request(router, m, max_new) for m in models])
        wall = time.perf_counter() - t0
        toks = sum(r["n"] for r in results)
        print(
            f"\n=== round 1: the base and {len(variants)} variants at once, cold (each delta streams from the store "
            f"into a worker on first use): {toks} tokens in {wall:.2f} s ({toks / wall:.1f} tok/s)\n"
        )
        for r in results:
            show(r)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_request(router, m, max_new) for m in models for _ in range(3)])
        wall = time.perf_counter() - t0
        toks = sum(r["n"] for r in results)
        print(
            f"=== round 2: 3 requests per model at once, warm: {toks} tokens in {wall:.2f} s ({toks / wall:.1f} tok/s); "
            f"requests for one variant share one worker and its resident delta\n"
        )
        for r in results:
            show(r, with_text=False)
        for m in models:
            same = [r for r in results if r["model"] == (m or "base")]
            assert len({r["text"] for r in same}) == 1, f"greedy answers for {m or 'base'} differ"
        print(
            "    (the three greedy answers of each model are identical: the workers run --batch-invariant, so a "
            "request's numbers do not depend on what shares its steps)\n"
        )

        cold = variants[-1]
        for addr in worker_addrs:
            async with WorkerClient(addr) as w:
                await w.evict_delta(cold)
        r = await one_request(router, cold, max_new)
        print(f"=== round 3: {cold!r} evicted from both workers, then requested again: cold\n")
        show(r, with_text=False)

        print("\n=== what the router reports (ListModels, ListWorkers)\n")
        for m in await router.list_models():
            kind = "base" if m.is_base else f"delta {m.delta_bytes / 2**20:5.1f} MiB"
            where = ", ".join(m.resident_on) or "-"
            print(
                f"    {m.model_id:28s} {kind:17s} resident on {where}"
                + ("" if m.servable else f"  NOT SERVABLE: {m.reason}")
            )
        print()
        for w in await router.list_workers():
            print(
                f"    worker {w.address:15s} {'up' if w.up else 'DOWN'} ({w.device}): {w.delta_used_bytes / 2**20:5.1f} "
                f"of {w.delta_budget_bytes / 2**20:.0f} MiB delta budget in use, resident: {', '.join(w.resident) or '-'}"
            )
        print(f"\n    try it: .venv/bin/bitdelta generate --router {router_addr} --model coder 'def add(a, b):'")
        print(
            f'            grpcurl -plaintext -d \'{{"model_id": "writer", "prompt": "ROMEO. "}}\' '
            f"{router_addr} bitdelta.router.v1.RouterService/Generate"
        )


def has_chat_template(base: Path) -> bool:
    cfg = base / "tokenizer_config.json"
    return (base / "chat_template.jinja").is_file() or (cfg.is_file() and "chat_template" in cfg.read_text())


async def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}; see its log in .tmp/demo-logs/")
        try:
            await asyncio.to_thread(urllib.request.urlopen, url, timeout=2)
            return
        except OSError:
            await asyncio.sleep(0.3)
    raise SystemExit(f"{what} did not answer {url} within {timeout:.0f} s")


async def openai_demo(base_url: str, variants: list[str], max_new: int, chat: bool) -> None:
    """The same family through the OpenAI-compatible gateway: one plain HTTP call (what curl sends)
    and the official `openai` SDK streaming from a variant."""
    import json
    import urllib.request

    model = variants[1] if len(variants) > 1 else variants[0]
    if chat:
        path, body = (
            "chat/completions",
            {
                "model": model,
                "max_tokens": max_new,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Write two lines about the sea."}],
            },
        )
    else:
        path, body = "completions", {"model": model, "prompt": PROMPTS[model], "max_tokens": max_new, "temperature": 0}
    print(
        f"\n=== the OpenAI-compatible gateway\n\n    curl {base_url}/{path} -H 'Content-Type: application/json' "
        f"-d '{json.dumps(body)}'\n"
    )
    req = urllib.request.Request(
        f"{base_url}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    r = json.loads((await asyncio.to_thread(urllib.request.urlopen, req, timeout=600)).read())
    choice = r["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    print(
        "    " + text.replace("\n", "\n    ") + f"\n    [{r['usage']['completion_tokens']} tokens, "
        f"finish_reason {choice['finish_reason']}]\n"
    )

    from openai import AsyncOpenAI

    code = variants[0]
    print(
        f"    client = AsyncOpenAI(base_url='{base_url}', api_key='unused')\n"
        f"    stream = await client.completions.create(model='{code}', prompt=..., stream=True)\n"
    )
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    stream = await client.completions.create(
        model=code, prompt=PROMPTS[code], max_tokens=max_new, temperature=0, stream=True
    )
    print("    " + PROMPTS[code].replace("\n", "\n    "), end="", flush=True)
    async for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text.replace("\n", "\n    "), end="", flush=True)
    print()
    await client.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--base", type=Path, help="base checkpoint (default: the family's data/base)")
    ap.add_argument("--deltas", type=Path, help="directory of delta files (default: the family's data/deltas)")
    ap.add_argument("--delta-budget", default="256MiB", help="each worker's delta budget")
    ap.add_argument("--keep-running", action="store_true", help="leave the services up until Ctrl-C")
    a = ap.parse_args()
    if a.base is None or a.deltas is None:
        from bitdelta import family

        p = family.paths()
        missing = [k for k, ok in p.exists().items() if not ok]
        if missing:
            raise SystemExit(f"the family is not built ({', '.join(missing)} missing): run `bitdelta family build`")
        a.base, a.deltas = a.base or p.base, a.deltas or p.deltas[p.variants[0]].parent
        variants = list(p.variants)
    else:
        variants = sorted(f.name.split(".")[0] for f in a.deltas.glob("*.bitdelta.safetensors"))
    for v in variants:
        PROMPTS.setdefault(v, "Once upon a time")

    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = ROOT / ".tmp" / "demo-logs"  # each service's log, so the answers below stay readable
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as f:
            return subprocess.Popen([py, *argv], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)

    store, workers, router = (f"127.0.0.1:{free_port()}" for _ in range(3))
    workers = [workers, f"127.0.0.1:{free_port()}"]
    procs: list[subprocess.Popen] = []
    try:
        shm = ["--shared-memory-dir", "/dev/shm/bitdelta-demo"] if Path("/dev/shm").is_dir() else []  # same host
        procs.append(
            spawn(
                "delta_store",
                ["-m", "services.delta_store", "--address", store, "--backend", "local", "--root", str(a.deltas), *shm],
            )
        )
        await wait_serving(store, procs[-1], "delta store")
        print(f"[demo] delta store on {store} serving {a.deltas}")
        for i, addr in enumerate(workers):
            procs.append(
                spawn(
                    f"worker{i + 1}",
                    [
                        "-m",
                        "services.gpu_worker",
                        "--base",
                        str(a.base),
                        "--address",
                        addr,
                        "--delta-store",
                        store,
                        "--delta-budget",
                        a.delta_budget,
                        "--batch-invariant",  # round 2's three answers per model: bit-identical, whatever batch
                    ],
                )
            )
        for i, addr in enumerate(workers):
            await wait_serving(addr, procs[1 + i], f"worker {i + 1}")
            print(f"[demo] worker {i + 1} on {addr} holds base {a.base} (--batch-invariant)")
        procs.append(
            spawn(
                "router",
                ["-m", "services.router", "--address", router, "--workers", ",".join(workers), "--delta-store", store],
            )
        )
        await wait_serving(router, procs[-1], "router")
        print(f"[demo] router on {router}: the only address gRPC clients need")
        gateway = f"127.0.0.1:{free_port()}"
        template = ["--chat-template", str(a.base)] if has_chat_template(a.base) else []
        procs.append(spawn("gateway", ["-m", "services.gateway", "--address", gateway, "--router", router, *template]))
        await wait_http(f"http://{gateway}/health", procs[-1], "gateway")
        print(f"[demo] OpenAI-compatible gateway on http://{gateway}/v1")
        await demo(router, workers, variants, a.max_new_tokens)
        await openai_demo(f"http://{gateway}/v1", variants, a.max_new_tokens, chat=bool(template))
        if a.keep_running:
            print("\n[demo] services keep running; Ctrl-C stops them")
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
            await stop.wait()
    except RouterCallError as e:
        raise SystemExit(f"[demo] request failed: {e}") from None
    finally:
        for proc in reversed(procs):  # router first, then workers, then the store: each drains
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in reversed(procs):
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append("killed")
        print(
            f"\n[demo] stopped gateway, router, workers and store (exit codes {codes}); logs: {logs.relative_to(ROOT)}/"
        )


if __name__ == "__main__":
    asyncio.run(main())
