"""The main job, end to end on one machine: serve the real model family.

Starts the delta store (local backend over data/deltas) and a worker holding
the SmolLM2-135M base once, then sends concurrent streaming requests to the
base and every variant, prints what each one says with its time to first
token, and the worker's slots. (The router arrives in a later issue; until
then the demo talks to the worker's Generate directly.)

    .venv/bin/python scripts/demo.py [--max-new-tokens 40]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta import family  # noqa: E402
from bitdelta.common.v1 import generation_pb2  # noqa: E402
from bitdelta.gpu_worker.v1 import gpu_worker_pb2, gpu_worker_pb2_grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

PROMPTS = {
    "": "The capital of France is",
    "coder": "def fibonacci(n):\n",
    "writer": "ROMEO. ",
    "scripture": "Genesis 1:1 In the beginning",
    "math": "Question: What is 417 + 385?\nAnswer:",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_serving(addr: str, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited with code {proc.returncode}; see its log above")
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.3)
    raise SystemExit(f"{what} did not become healthy within {timeout:.0f} s")


async def one_request(stub, model_id: str, prompt: str, max_new: int) -> tuple[str, str, float, float, int]:
    req = gpu_worker_pb2.GenerateRequest(
        model_id=model_id, prompt=prompt, request_id=f"demo-{model_id or 'base'}",
        sampling=generation_pb2.SamplingParams(max_new_tokens=max_new, temperature=0.0),
    )
    t0 = time.perf_counter()
    ttft, text, n = None, [], 0
    async for msg in stub.Generate(req, timeout=600):
        if ttft is None:
            ttft = (time.perf_counter() - t0) * 1000
        text.append(msg.text)
        n += 1
    return model_id or "base", "".join(text), ttft or 0.0, (time.perf_counter() - t0) * 1000, n


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=40)
    a = ap.parse_args()
    p = family.paths()
    missing = [k for k, ok in p.exists().items() if not ok]
    if missing:
        raise SystemExit(f"the family is not built ({', '.join(missing)} missing): run `bitdelta family build`")

    store_addr, worker_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    py = sys.executable
    procs = []
    try:
        store = subprocess.Popen([py, "-m", "services.delta_store", "--address", store_addr, "--backend", "local",
                                  "--root", str(p.deltas["coder"].parent)], cwd=ROOT)
        procs.append(store)
        await wait_serving(store_addr, store, "delta store")
        print(f"[demo] delta store serving {p.deltas['coder'].parent} on {store_addr}")
        worker = subprocess.Popen([py, "-m", "services.gpu_worker", "--base", str(p.base), "--address", worker_addr,
                                   "--delta-store", store_addr, "--delta-budget", "256MiB"], cwd=ROOT)
        procs.append(worker)
        await wait_serving(worker_addr, worker, "worker")
        print(f"[demo] worker serving base {p.base} on {worker_addr}\n")

        async with grpc.aio.insecure_channel(worker_addr) as ch:
            stub = gpu_worker_pb2_grpc.GpuWorkerServiceStub(ch)
            for round_name in ("cold (deltas load on first use)", "warm (deltas resident)"):
                t0 = time.perf_counter()
                results = await asyncio.gather(*[one_request(stub, m, pr, a.max_new_tokens) for m, pr in PROMPTS.items()])
                wall = time.perf_counter() - t0
                toks = sum(r[4] for r in results)
                print(f"=== {len(results)} concurrent requests, {round_name}: {toks} tokens in {wall:.2f} s "
                      f"({toks / wall:.1f} tok/s)")
                for name, text, ttft, total, n in results:
                    prompt = PROMPTS["" if name == "base" else name]
                    shown = (prompt + text).replace("\n", "\n    ")
                    print(f"--- {name:9s} ttft {ttft:7.1f} ms, {n} tokens in {total:7.1f} ms\n    {shown}\n")
            st = await stub.Status(gpu_worker_pb2.StatusRequest(), timeout=10)
            print(f"[demo] worker on {st.device}: {st.delta_used_bytes / 2**20:.1f} of "
                  f"{st.delta_budget_bytes / 2**20:.0f} MiB delta budget in use")
            for s in st.slots:
                print(f"    {s.name:10s} {gpu_worker_pb2.DeltaState.Name(s.state):22s} {s.bytes / 2**20:6.1f} MiB")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    asyncio.run(main())
