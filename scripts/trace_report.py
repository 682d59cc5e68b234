"""A real run of the system, traced: the TTFT breakdown per variant and arrival state from spans.

    .venv/bin/python scripts/trace_report.py [--data data] [--out reports/traces]

Starts an OTLP sink (`bitdelta traces collect`'s), a delta store over <data>/deltas, two workers
on the real base <data>/base and a router, all exporting traces to the sink through the
standard OTEL_EXPORTER_OTLP_ENDPOINT; sends rounds of requests (cold, then concurrent so some
arrive while the delta loads, then warm); then runs `bitdelta traces ttft` on the spans file and
writes <out>/ttft.png, <out>/ttft.txt and the spans (<out>/spans.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta import traces  # noqa: E402
from bitdelta.rpc.clients.router import RouterClient  # noqa: E402
from bitdelta.testing.cluster import Cluster  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea:", "Question: 2 + 2 ="]


async def traffic(address: str, variants: list[str], rounds: int) -> None:
    async with RouterClient(address, generate_timeout_s=300) as r:
        deadline = time.monotonic() + 300
        while not (
            all(w.up for w in await r.list_workers())
            and {m.model_id for m in await r.list_models() if m.servable} >= set(variants) - {""}
        ):
            assert time.monotonic() < deadline, "router not ready"
            await asyncio.sleep(0.2)

        async def one(v: str, i: int) -> None:
            [m async for m in r.generate(v, PROMPTS[i % len(PROMPTS)], max_new_tokens=16)]

        for _ in range(rounds):
            for w in await r.list_workers():  # evict so each round starts cold
                from bitdelta.rpc.clients.worker import WorkerClient

                async with WorkerClient(w.address) as wc:
                    for v in variants:
                        if v != "":
                            await wc.evict_delta(v)
            await asyncio.gather(*(one(v, i) for v in variants for i in range(4)))  # cold + loading
            for i in range(4):
                await asyncio.gather(*(one(v, i) for v in variants))  # resident


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, default=ROOT / "data")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "traces")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    spans = a.out / "spans.jsonl"
    spans.unlink(missing_ok=True)
    sink = traces.OtlpFileSink(spans)
    variants = ["base"] + sorted(f.name.split(".")[0] for f in (a.data / "deltas").glob("*.bitdelta.safetensors"))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), env=env) as c:
        st = c.store(a.data / "deltas")
        ws = [
            c.worker(a.data / "base", st.address, name=f"worker{i}", delta_budget="256MiB", kv_cache="64MiB")
            for i in range(2)
        ]
        r = c.router([w.address for w in ws], st.address)
        c.wait_serving(st, *ws, r)
        asyncio.run(traffic(r.address, [v if v != "base" else "" for v in variants], a.rounds))
        time.sleep(2)  # the last batch of spans
    sink.stop()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bitdelta.cli",
            "traces",
            "ttft",
            "--from",
            str(spans),
            "--png",
            str(a.out / "ttft.png"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (a.out / "ttft.txt").write_text(out)
    print(out)


if __name__ == "__main__":
    main()
