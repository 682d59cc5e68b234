"""What batching streamed tokens into messages saves on the worker -> router -> client path: messages
per second and CPU time per token with many concurrent streams, against the per-token stream
(`--stream-max-tokens 1` on worker and router) measured in the same run.

Starts a delta store and two worker + router pairs as processes on loopback (the tiny random
family's base; `--max-running` and the router's in-flight limit set to `--concurrency`, so every
stream is in the batch): one pair with one message per token (the baseline), one with every
ready token in one message (the default). Rounds alternate baseline / batched (`--rounds` each, so the other
load on the machine meets both alike); in each, `--concurrency` closed-loop clients stream
`--tokens`-token greedy generations through the router for `--seconds`, in two scenarios:
"fast" clients read as fast as they can; "slow" clients pause `--slow-pause-ms` after each
message with a small HTTP/2 receive window (1 KiB, no BDP growth), so the router's writes wait
on flow control as behind any reader slower than the model. Per round: tokens/s and messages/s
the clients received, and the CPU seconds the worker, the router and the client process spent
(from /proc), per token.

    python bench/stream_batching.py [--concurrency 64] [--tokens 128] [--seconds 8] [--rounds 2] \
        [--slow-pause-ms 100] [--out bench/results/stream_batching_cpu_<date>.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta.common.v1 import generation_pb2 as gen_pb  # noqa: E402
from bitdelta.router.v1 import router_pb2 as rpb  # noqa: E402
from bitdelta.router.v1 import router_pb2_grpc as rpb_grpc  # noqa: E402
from bitdelta.rpc.clients.router import RouterClient  # noqa: E402
from bitdelta.testing.report import save as save_report  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
MODES = {"per_token": "1", "batched": "0"}  # --stream-max-tokens of worker and router
SCENARIOS = ("fast", "slow")
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]  # the slow clients'


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


async def load(stub, concurrency: int, tokens: int, seconds: float, pause_s: float = 0.0) -> dict:
    """`concurrency` closed-loop clients of the router `stub` for `seconds`, pausing `pause_s` after
    each message: tokens and messages received."""
    sampling = gen_pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    req = rpb.GenerateRequest(model_id="", prompt="The quick brown fox", sampling=sampling)
    got = {"tokens": 0, "messages": 0, "requests": 0}
    stop = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < stop:
            async for m in stub.Generate(req, timeout=600):
                got["messages"] += 1
                got["tokens"] += len(m.tokens)
                if pause_s:
                    await asyncio.sleep(pause_s)
            got["requests"] += 1

    t = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    got["wall_s"] = time.perf_counter() - t
    return got


async def run(a: argparse.Namespace) -> dict:
    from bitdelta.testing.cluster import Cluster
    from bitdelta.testing.family import make_test_family

    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        fam = make_test_family(Path(tmp) / "family", n_variants=1, merged=False)
        with Cluster(Path(tmp) / "cluster") as c:
            st = c.store(fam.deltas)
            pairs = {}
            for mode, cap in MODES.items():
                batch = str(a.concurrency)  # every stream in the worker's batch and in flight on the router
                w = c.worker(
                    fam.base,
                    st.address,
                    name=f"worker-{mode}",
                    kv_cache="256MiB",
                    extra=("--stream-max-tokens", cap, "--max-running", batch),
                )
                r = c.router(
                    [w.address],
                    st.address,
                    name=f"router-{mode}",
                    extra=("--stream-max-tokens", cap, "--max-in-flight-per-worker", batch, "--max-queue", batch),
                )
                pairs[mode] = (w, r)
            c.wait_serving(st, *[p for pair in pairs.values() for p in pair])
            channels = {
                (mode, sc): grpc.aio.insecure_channel(r.address, options=SMALL_WINDOW if sc == "slow" else None)
                for mode, (_, r) in pairs.items()
                for sc in SCENARIOS
            }
            stubs = {k: rpb_grpc.RouterServiceStub(ch) for k, ch in channels.items()}
            try:
                for mode, (_, r) in pairs.items():  # warm: the router sees its worker, kernels touched
                    async with RouterClient(r.address) as router:
                        while not all(x.up for x in await router.list_workers()):
                            await asyncio.sleep(0.1)
                    await load(stubs[mode, "fast"], a.concurrency, a.tokens, 1.0)
                for i in range(a.rounds):
                    for sc in SCENARIOS:
                        for mode in MODES:
                            w, r = pairs[mode]
                            pids = {"worker": w.popen.pid, "router": r.popen.pid, "client": os.getpid()}
                            before = {k: cpu_s(p) for k, p in pids.items()}
                            pause = a.slow_pause_ms / 1e3 if sc == "slow" else 0.0
                            got = await load(stubs[mode, sc], a.concurrency, a.tokens, a.seconds, pause)
                            got["cpu_s"] = {k: cpu_s(p) - before[k] for k, p in pids.items()}
                            rounds.append({"mode": mode, "scenario": sc, "round": i, **got})
            finally:
                for ch in channels.values():
                    await ch.close()
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "concurrency": a.concurrency,
        "tokens_per_request": a.tokens,
        "seconds": a.seconds,
        "slow_pause_ms": a.slow_pause_ms,
        "rounds": rounds,
    }


def summary(res: dict) -> dict:
    """Per scenario and mode, medians over its rounds: tokens/s, messages/s, tokens per message, CPU
    ms per token."""
    out = {}
    for sc, mode in ((sc, mode) for sc in SCENARIOS for mode in MODES):
        rs = [r for r in res["rounds"] if r["mode"] == mode and r["scenario"] == sc]
        med = lambda f: statistics.median(f(r) for r in rs)
        out[f"{sc}/{mode}"] = {
            "tok_s": med(lambda r: r["tokens"] / r["wall_s"]),
            "msg_s": med(lambda r: r["messages"] / r["wall_s"]),
            "tok_per_msg": med(lambda r: r["tokens"] / r["messages"]),
            **{
                f"cpu_ms_per_tok_{k}": med(lambda r, k=k: r["cpu_s"][k] * 1e3 / r["tokens"])
                for k in ("worker", "router", "client")
            },
        }
    return out


def report(res: dict) -> str:
    s = summary(res)
    lines = [
        f"stream batching benchmark, {res['date']}, {res['machine']} (shared: absolute numbers are noisy, the "
        "ratios are against the baseline measured in the same run), tiny random base, store + 2 (worker, router) "
        "pairs as processes on loopback",
        f"{res['concurrency']} concurrent greedy streams of {res['tokens_per_request']} tokens through the router, "
        f"{res['seconds']:.0f} s per round, {len(res['rounds']) // len(MODES) // len(SCENARIOS)} rounds per mode "
        "alternating; medians:",
    ]
    rows = [
        ("tokens/s at client", "tok_s", "{:.0f}"),
        ("messages/s at client", "msg_s", "{:.0f}"),
        ("tokens per message", "tok_per_msg", "{:.2f}"),
        ("CPU ms/token worker", "cpu_ms_per_tok_worker", "{:.3f}"),
        ("CPU ms/token router", "cpu_ms_per_tok_router", "{:.3f}"),
        ("CPU ms/token client", "cpu_ms_per_tok_client", "{:.3f}"),
    ]
    hops = lambda x: x["cpu_ms_per_tok_worker"] + x["cpu_ms_per_tok_router"]
    for sc in SCENARIOS:
        b, p = s[f"{sc}/batched"], s[f"{sc}/per_token"]
        what = "read as fast as they can" if sc == "fast" else f"pause {res['slow_pause_ms']:g} ms per message"
        lines.append(f"{sc} clients ({what}):")
        lines.append(f"  {'':22s}{'per token (baseline)':>22s}{'batched':>12s}{'ratio':>8s}")
        for name, key, fmt in rows:
            lines.append(f"  {name:22s}{fmt.format(p[key]):>22s}{fmt.format(b[key]):>12s}{b[key] / p[key]:>8.2f}")
        lines.append(f"  {'CPU ms/token w+r':22s}{hops(p):>22.3f}{hops(b):>12.3f}{hops(b) / hops(p):>8.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slow-pause-ms", type=float, default=100.0)
    ap.add_argument("--out", type=Path, help="write the report here (and the numbers as .json beside it)")
    a = ap.parse_args()
    res = asyncio.run(run(a))
    res["summary"] = summary(res)
    text = report(res)
    save_report(a.out, text, res)


if __name__ == "__main__":
    main()
