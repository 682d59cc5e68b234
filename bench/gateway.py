"""What the HTTP gateway costs: its time to first token against calling the router directly, under
a bounded concurrent load, measured in one run on loopback.

Starts a delta store, one worker, the router and the gateway as processes (the tiny random family
with `--variants` variants, so the HTTP layer is a visible share of the time; on a real model it is
a smaller one). For each concurrency in `--concurrency`, `--rounds` times in turn: `C` closed-loop
clients send streamed requests for random resident variants (`--tokens` tokens each) for
`--seconds`, once through the gateway (`POST /v1/completions`, `stream: true`, over one keep-alive
HTTP/1.1 connection per client, read as raw bytes so the client's own parsing is not counted), once
straight to the router (`RouterClient.generate`). Time to first token is from sending the request
to the first token's bytes (the first SSE `data:` event, the first gRPC message). Printed: p50 and
p99 of each and their ratios gateway ÷ router, and requests/s of both.

In the same run, what logprobs and penalties cost per decode step: `--decode-concurrency` closed-loop
clients stream `--decode-tokens` greedy tokens from random variants through the router, in turn
plain, with `logprobs` (the sampled token's and 5 alternatives per token) and with penalties
(repetition 1.2, presence 0.5, frequency 0.5: each row through the CPU sampler), `--rounds` times
for `--seconds` each. Printed per mode: the median milliseconds per decode step of a stream (first
token to last ÷ tokens after the first), decode tokens/s over all streams, and both ÷ plain.

And what one constrained row costs its batch: `--decode-concurrency` greedy streams, all free or
one of them constrained by `TYPICAL_SCHEMA` (its strings have no bound, so the random model's row
decodes every token under the mask), alternating; printed: decode tokens/s of the batch with the
constrained row ÷ without (target >= 0.9), and the constrained row's ms per step. Then, in this
process on `--grammar-tokenizer` (the real base's when data/base exists: 49,152 tokens): the
worker's GrammarCompiler's tokenizer set-up, the compile of `TYPICAL_SCHEMA` (first and cached), and
the mask per token (services/gpu_worker/constraints.py, over random allowed tokens).

    python bench/gateway.py [--variants 4] [--concurrency 1,8] [--seconds 5] [--rounds 2] [--tokens 16] \
        [--decode-tokens 64] [--decode-concurrency 8] [--grammar-tokenizer data/base/tokenizer.json] \
        [--out bench/results/gateway_cpu_<date>.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta.generation import Constraint, ConstraintKind, Sampling  # noqa: E402
from bitdelta.router.v1 import router_pb2 as rpb  # noqa: E402
from bitdelta.rpc.clients.router import RouterClient  # noqa: E402
from bitdelta.testing.report import save as save_report  # noqa: E402

PROMPT = "The quick brown fox"
DECODE_MODES = {  # name -> the Sampling fields of the decode benchmark, greedy throughout
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5},
}

# an extraction schema as clients send them: nested object, array, enum, a format, free strings
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "email", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_CONSTRAINT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(TYPICAL_SCHEMA))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class HttpStream:
    """One keep-alive HTTP/1.1 connection to the gateway; `complete()` -> ms to the first SSE event."""

    def __init__(self, address: str):
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.reader = self.writer = None

    async def complete(self, model: str, tokens: int) -> float:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(
            {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        t = time.perf_counter()
        self.writer.write(head + body)
        buf, ttft = b"", None
        while not buf.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked body
            data = await self.reader.read(65536)
            if not data:
                raise RuntimeError(f"the gateway closed the connection: {buf[:300]!r}")
            buf += data
            if ttft is None and b"data: {" in buf:
                ttft = (time.perf_counter() - t) * 1e3
        if not buf.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in buf:
            raise RuntimeError(f"bad answer: {buf[:300]!r}")
        return ttft

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def ttft_router(r: RouterClient, model: str, tokens: int) -> float:
    t, ttft = time.perf_counter(), None
    async for _ in r.generate(model, PROMPT, max_new_tokens=tokens):
        if ttft is None:
            ttft = (time.perf_counter() - t) * 1e3
    return ttft


async def decode(r: RouterClient, model: str, sampling: Sampling) -> tuple[float, int]:
    """(ms per decode step of one stream, its decode tokens: those after the first)."""
    req = rpb.GenerateRequest(model_id=model, prompt=PROMPT, sampling=sampling.to_pb())
    t_first, n = None, 0
    async for m in r.generate_request(req):
        n += len(m.tokens)  # a message holds every token the router had ready
        if t_first is None:
            t_first = time.perf_counter()
    return (time.perf_counter() - t_first) * 1e3 / max(1, n - 1), n - 1


async def decode_load(r: RouterClient, models: list[str], samplings: list[Sampling], conc: int, seconds: float):
    """(ms per step of every stream, decode tokens/s over all, ms per step of client 0's streams) of
    `conc` closed-loop clients; client i streams with samplings[min(i, len - 1)]."""
    steps: list[float] = []
    first: list[float] = []
    tokens = 0
    stop = time.perf_counter() + seconds

    async def client(seed: int):
        nonlocal tokens
        rng = random.Random(seed)
        sampling = samplings[min(seed, len(samplings) - 1)]
        while time.perf_counter() < stop:
            ms, n = await decode(r, rng.choice(models), sampling)
            steps.append(ms)
            if seed == 0:
                first.append(ms)
            tokens += n

    t = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(conc)])
    return steps, tokens / (time.perf_counter() - t), first


async def grammar_costs(tokenizer_json: Path, rounds: int = 200) -> dict:
    """The worker's GrammarCompiler in this process: tokenizer set-up, TYPICAL_SCHEMA's compile
    (first, cached) and the mask per token over random allowed tokens, in ms."""
    import torch

    from services.gpu_worker.constraints import GrammarCompiler

    tok = json.loads(tokenizer_json.read_text())
    added = [t["id"] for t in tok.get("added_tokens", [])]
    n_vocab = max([*tok["model"]["vocab"].values(), *added]) + 1
    config = tokenizer_json.parent / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    eos = [eos] if isinstance(eos, int) else list(eos or added[:1] or [0])
    compiler = GrammarCompiler(tokenizer_json, n_vocab, eos)

    t = time.perf_counter()
    await asyncio.to_thread(compiler._tokenizer_of)
    setup = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    g = await compiler.compile(SCHEMA_CONSTRAINT)
    first = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    await compiler.compile(SCHEMA_CONSTRAINT)
    cached = (time.perf_counter() - t) * 1e3
    rng = torch.Generator().manual_seed(0)
    state, masks = g.start(), []
    for _ in range(rounds):
        row = torch.randn(n_vocab, generator=rng)
        t = time.perf_counter()
        state.mask(row)
        masks.append((time.perf_counter() - t) * 1e3)
        tok = int(torch.multinomial(torch.softmax(row, -1), 1, generator=rng))
        if tok in eos:
            state = g.start()
            continue
        state.accept(tok)
    compiler.close()
    return {
        "tokenizer": str(
            tokenizer_json.relative_to(ROOT) if tokenizer_json.is_relative_to(ROOT) else tokenizer_json.name
        ),
        "vocab": n_vocab,
        "tokenizer_setup_ms": setup,
        "compile_ms": first,
        "compile_cached_ms": cached,
        "mask_ms_mean": statistics.mean(masks),
        "mask_ms_p99": pct(masks, 0.99),
    }


async def load(make_send, models: list[str], concurrency: int, seconds: float) -> tuple[list[float], float]:
    """(time to first token of every request in ms, requests/s) of `concurrency` closed-loop clients."""
    ttfts: list[float] = []
    stop = time.perf_counter() + seconds

    async def client(seed: int):
        rng = random.Random(seed)
        send, close = await make_send()
        try:
            while time.perf_counter() < stop:
                ttfts.append(await send(rng.choice(models)))
        finally:
            await close()

    t = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(concurrency)])
    return ttfts, len(ttfts) / (time.perf_counter() - t)


async def run(a: argparse.Namespace) -> dict:
    from bitdelta.testing.cluster import Cluster
    from bitdelta.testing.family import make_test_family

    with tempfile.TemporaryDirectory() as tmp:
        fam = make_test_family(Path(tmp) / "family", n_variants=a.variants, merged=False)
        for bad in (fam.corrupt, fam.other_base):
            os.remove(fam.delta_path(bad))
        with Cluster(Path(tmp) / "cluster") as c:
            st = c.store(fam.deltas)
            w = c.worker(fam.base, st.address, delta_budget="64MiB")
            r = c.router([w.address], st.address)
            c.wait_serving(st, w, r)
            g = c.gateway(r.address)
            async with RouterClient(r.address) as router:
                while not all(x.up for x in await router.list_workers()):
                    await asyncio.sleep(0.1)
                models = [m.model_id for m in await router.list_models() if m.servable]
                warm = HttpStream(g.address)
                for m in models:  # every delta resident, both paths touched
                    await ttft_router(router, m, 2)
                    await warm.complete(m, 2)
                await warm.close()

                async def via_gateway():
                    s = HttpStream(g.address)
                    return (lambda m: s.complete(m, a.tokens)), s.close

                async def via_router():
                    async def nothing():
                        pass

                    return (lambda m: ttft_router(router, m, a.tokens)), nothing

                out = {}
                for conc in a.concurrency:
                    gw, direct, gw_rps, direct_rps = [], [], [], []
                    for _ in range(a.rounds):  # alternate, so drift on a shared machine hits both alike
                        x, rps = await load(via_gateway, models, conc, a.seconds)
                        gw += x
                        gw_rps.append(rps)
                        x, rps = await load(via_router, models, conc, a.seconds)
                        direct += x
                        direct_rps.append(rps)
                    out[conc] = {
                        "requests": [len(gw), len(direct)],
                        "gateway_p50": statistics.median(gw),
                        "gateway_p99": pct(gw, 0.99),
                        "router_p50": statistics.median(direct),
                        "router_p99": pct(direct, 0.99),
                        "gateway_req_s": statistics.mean(gw_rps),
                        "router_req_s": statistics.mean(direct_rps),
                    }
                dec = {m: ([], []) for m in DECODE_MODES}
                for _ in range(a.rounds):  # the modes alternate, so drift hits all alike
                    for mode, fields in DECODE_MODES.items():
                        sp = Sampling(max_new_tokens=a.decode_tokens, ignore_eos=True, **fields)
                        steps, tps, _ = await decode_load(router, models, [sp], a.decode_concurrency, a.seconds)
                        dec[mode][0].extend(steps)
                        dec[mode][1].append(tps)
                decode_out = {
                    m: {"streams": len(st), "step_ms_p50": statistics.median(st), "tok_s": statistics.mean(tps)}
                    for m, (st, tps) in dec.items()
                }
                # one constrained row (client 0) among free ones; its strings are unbounded, so it mostly runs to the end
                free = Sampling(max_new_tokens=a.decode_tokens, ignore_eos=True)
                held = Sampling(max_new_tokens=a.decode_tokens, constraint=SCHEMA_CONSTRAINT)
                await decode(router, models[0], held)  # compiled once before the clock runs (cached after)
                con = {"free": ([], [], []), "one constrained": ([], [], [])}
                for _ in range(a.rounds):
                    for mode, samplings in (("free", [free]), ("one constrained", [held, free])):
                        steps, tps, first = await decode_load(
                            router, models, samplings, a.decode_concurrency, a.seconds
                        )
                        con[mode][0].extend(steps)
                        con[mode][1].append(tps)
                        con[mode][2].extend(first)
                grammar = await grammar_costs(a.grammar_tokenizer or fam.base / "tokenizer.json")
                constrained_out = {
                    m: {
                        "streams": len(st),
                        "step_ms_p50": statistics.median(st),
                        "tok_s": statistics.mean(tps),
                        "row0_step_ms_p50": statistics.median(first),
                    }
                    for m, (st, tps, first) in con.items()
                }
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "variants": a.variants,
        "seconds": a.seconds,
        "rounds": a.rounds,
        "tokens_per_request": a.tokens,
        "by_concurrency": out,
        "decode_tokens": a.decode_tokens,
        "decode_concurrency": a.decode_concurrency,
        "decode": decode_out,
        "constrained": constrained_out,
        "grammar": grammar,
    }


def report(res: dict) -> str:
    lines = [
        f"gateway benchmark, {res['date']}, {res['machine']}, tiny random family with {res['variants']} "
        "variants + base, store + worker + router + gateway as processes on loopback",
        f"time to first token of streamed requests ({res['tokens_per_request']} tokens each, resident variants), "
        f"closed-loop clients, {res['rounds']} x {res['seconds']:.0f} s per path, paths alternating:",
    ]
    for conc, t in res["by_concurrency"].items():
        lines += [
            f"  {conc} concurrent ({t['requests'][0]} via gateway, {t['requests'][1]} direct):",
            f"    p50: gateway {t['gateway_p50']:.2f} ms vs router {t['router_p50']:.2f} ms -> "
            f"ratio {t['gateway_p50'] / t['router_p50']:.2f} (+{t['gateway_p50'] - t['router_p50']:.2f} ms)",
            f"    p99: gateway {t['gateway_p99']:.2f} ms vs router {t['router_p99']:.2f} ms -> "
            f"ratio {t['gateway_p99'] / t['router_p99']:.2f} (+{t['gateway_p99'] - t['router_p99']:.2f} ms)",
            f"    throughput: gateway {t['gateway_req_s']:.1f} req/s vs router {t['router_req_s']:.1f} req/s -> "
            f"ratio {t['gateway_req_s'] / t['router_req_s']:.2f}",
        ]
    plain = res["decode"]["plain"]
    lines.append(
        f"decode cost per step: {res['decode_concurrency']} concurrent streams of {res['decode_tokens']} greedy "
        f"tokens through the router, {res['rounds']} x {res['seconds']:.0f} s per mode, modes alternating:"
    )
    for mode, d in res["decode"].items():
        lines.append(
            f"  {mode:<9} ({d['streams']} streams): {d['step_ms_p50']:.2f} ms/step p50 "
            f"({d['step_ms_p50'] / plain['step_ms_p50']:.2f} x plain), {d['tok_s']:.0f} decode tok/s "
            f"({d['tok_s'] / plain['tok_s']:.2f} x plain)"
        )
    con = res["constrained"]
    free, one = con["free"], con["one constrained"]
    lines += [
        f"one constrained row in a batch of {res['decode_concurrency']}: greedy streams of {res['decode_tokens']} "
        f"tokens, all free or client 0's constrained by a typical JSON schema, alternating:",
        f"  decode tok/s {one['tok_s']:.0f} with it vs {free['tok_s']:.0f} without -> ratio "
        f"{one['tok_s'] / free['tok_s']:.2f} (target >= 0.9); ms/step p50 {one['step_ms_p50']:.2f} vs "
        f"{free['step_ms_p50']:.2f}; the constrained row's own {one['row0_step_ms_p50']:.2f} ms/step",
    ]
    g = res["grammar"]
    lines.append(
        f"grammar costs on {g['tokenizer']} ({g['vocab']} tokens), in process: tokenizer set-up "
        f"{g['tokenizer_setup_ms']:.0f} ms once; the typical schema's compile {g['compile_ms']:.1f} ms "
        f"(cached: {g['compile_cached_ms']:.2f} ms); mask per token {g['mask_ms_mean']:.3f} ms mean, "
        f"{g['mask_ms_p99']:.3f} ms p99"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=4)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-concurrency", type=int, default=8)
    default_tok = ROOT / "data" / "base" / "tokenizer.json"
    ap.add_argument(
        "--grammar-tokenizer",
        type=Path,
        default=default_tok if default_tok.is_file() else None,
        help="tokenizer.json the compile and mask costs are measured on (default: the real base's, else the tiny family's)",
    )
    ap.add_argument("--out", type=Path, help="write the report here (and the numbers as .json beside it)")
    a = ap.parse_args()
    res = asyncio.run(run(a))
    text = report(res)
    save_report(a.out, text, res)


if __name__ == "__main__":
    main()
