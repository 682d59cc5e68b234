"""The worker against llama.cpp on the same model and CPU, one run: issue #23's table as ratios.

    bash bench/peer_env.sh                 # once: llama-cpp-python built from source + GGUF files
    python bench/peer_cpu.py [--threads 1] [--rounds 3] [--out bench/results/peer_cpu_<date>.txt]

Both peers run as processes with the same thread count: the worker (`python -m
services.gpu_worker`, over gRPC on loopback, the real SmolLM2-135M in data/base and the real
family deltas) and llama.cpp (llama-cpp-python in build/peer-venv, the benchmark's own
environment, never the worker's; f32 and bf16 GGUF converted from the same checkpoint).

The whole measure runs --rounds times (a worker per dtype, then llama.cpp, then the next round),
every ratio is taken within one round, and the table gives each cell's median over the rounds
with the ratios' range across them: this host's read bandwidth moved between 37 and 74 GB/s within
minutes, so a single round's ratio of two peers measured a minute apart is partly the host's.

Rows (decode: tokens/s of one greedy stream after its first token, the best of --reps runs, the
base's, the variant's and the 8-stream runs taken in turns so that their ratios compare like
moments; limits: the bytes a decode step must read ÷ the memory read bandwidth measured in the
same round, in this process, as
the best of several sums over a 512 MiB tensor with the same threads, on 2 MB pages as the
worker's weights are (a read on 4 KB pages measured ~10 % slower here), sampled at the round's
start and after each peer, the best sample counting: on a shared machine one sample can fall in a
busy moment and make the limit look easy; llama.cpp: the better of its weights mmap'ed, its
default, and loaded into its own memory, `use_mmap=False`, per measure; its idle RSS the default's):
- single-stream decode fp32 and bf16: worker ÷ llama.cpp (target ≥ 1.0) and ÷ the limit
  (target ≥ 0.85);
- a variant's single stream ÷ the base's (target ≥ 0.95; its limit W ÷ (W + delta bytes));
- prefill of ~560 prompt tokens (time to the first token), fp32 and bf16;
- 8 streams over 4 variants ÷ 8 streams on the base, fp32, against the limit 4/(4 + V/8)
  (target ≥ 0.9 × it);
- with `--lora R`, a LoRA adapter of rank R on every projection (random, seeded:
  `bitdelta.testing.family.make_lora`), each peer's single stream with it ÷ its own base's, fp32
  and bf16, against the limit W ÷ (W + the factors' fp16 bytes); the worker serves the adapter as
  `bitdelta import-lora` writes it, llama.cpp as its own converter (convert_lora_to_gguf.py, f16
  factors, the same bytes) writes it, applied at run time (`lora_path`), neither merged;
- idle resident memory of each process (VmRSS) against the worker's account
  (services/gpu_worker/memory.py): weights + KV pool + the slots' α/norm rows (resident from
  start; the signs only as slots fill) + the runtime's fixed cost, measured in the same run as
  the idle RSS of the same worker serving a one-layer model of width 8 with the same tokenizer
  (bitdelta.testing.memory.empty_base), per dtype.

On a shared machine every number moves with the other work on it: run it on an idle one, and
compare only ratios of one round.
"""

from __future__ import annotations

import os

# torch reads this once, at the first tensor: the bandwidth sample's buffer on 2 MB pages, as the
# worker process puts its weights (services/gpu_worker/__main__.py)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta.testing.memory import EMPTY_FLAGS, EMPTY_KV, empty_base, vm_rss  # noqa: E402
from bitdelta.testing.report import save as save_report  # noqa: E402

PROMPT_WORDS = (
    "The history of computing is a story of machines that learned to remember, to count and "
    "finally to reason about the world in ways their builders did not foresee. "
)
DECODE_PROMPT = "Once upon a time, in a small village by the sea, there lived"

# llama.cpp's side: run by the peer's own python (llama_cpp is only installed there)
PEER_SCRIPT = r"""
import json, sys, time
import llama_cpp
cfg = json.loads(sys.argv[1])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def load(path, **kw):
    return llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=1024, n_threads=cfg["threads"],
                           n_threads_batch=cfg["threads"], verbose=False, **kw)
def decode_tok_s(llm):
    # tokens/s of one greedy stream after its first token, the best of the reps
    best = 0.0
    for _ in range(cfg["reps"]):
        llm.reset()
        times = []
        for tok in llm.generate(llm.tokenize(cfg["short"].encode(), add_bos=True), top_k=1, temp=0.0):
            times.append(time.perf_counter())
            if len(times) >= cfg["new_tokens"]:
                break
        best = max(best, (len(times) - 1) / (times[-1] - times[0]))
    return best
out = {}
for dtype, path in cfg["gguf"].items():
    res = {"prefill_s": 1e9, "decode_tok_s": 0.0}
    for mmap in (True, False):  # its default, then the weights in its own memory: the better counts
        llm = load(path, use_mmap=mmap)
        time.sleep(0.5)
        if mmap:
            res["rss_idle"] = rss()
        toks = llm.tokenize(cfg["long"].encode(), add_bos=True)
        for _ in range(cfg["reps"]):
            llm.reset()
            t = time.perf_counter(); llm.eval(toks); res["prefill_s"] = min(res["prefill_s"], time.perf_counter() - t)
        res["prefill_tokens"] = len(toks)
        res["decode_tok_s"] = max(res["decode_tok_s"], decode_tok_s(llm))
        del llm
    out[dtype] = res
for dtype, path in cfg["gguf"].items() if cfg.get("lora") else ():
    # the same decode with the adapter applied at run time (its default mmap), after every idle RSS
    llm = load(path, lora_path=cfg["lora"])
    out[dtype]["lora_tok_s"] = decode_tok_s(llm)
    del llm
print(json.dumps(out))
"""


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def read_bandwidth(threads: int, reps: int = 7) -> float:
    """Bytes/s of the best of `reps` sums over a 512 MiB fp32 tensor (far beyond any cache)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(128 << 20)
    a.sum()
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def make_deltas(src: dict[str, Path], out: Path, n: int) -> list[str]:
    """`n` variants in `out`: the real deltas, then copies of them with fresh random signs (same
    structure and α: the same bytes per step as a real one)."""
    import torch

    from bitdelta.format import load_delta, write_delta

    out.mkdir(parents=True, exist_ok=True)
    names = []
    real = list(src.items())
    for i in range(n):
        name, path = real[i % len(real)]
        if i < len(real):
            shutil.copy(path, out / path.name)
            names.append(name)
            continue
        d = load_delta(path)
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for p, cw in d.compressed.items():
            tensors[p + ".sign"] = torch.randint(0, 256, cw.signs.shape, dtype=torch.uint8, generator=g)
            tensors[p + ".alpha"] = cw.alpha
        for p, t in d.dense.items():
            tensors[p + ".dense"] = t
        meta = d.meta
        meta.variant = f"copy{i}"
        write_delta(out / f"copy{i}.bitdelta.safetensors", tensors, meta)
        names.append(meta.variant)
    return names


LORA = "lora"  # the --lora variant's name


def with_lora(args, work: Path, deltas: Path, env: dict) -> int:
    """The --lora adapter (`make_lora`) imported into `deltas` for the worker and converted to GGUF
    (f16) for llama.cpp (args.lora_gguf) by the converter of the source it was built from, run as
    bench/peer_env.sh runs convert_hf_to_gguf.py; returns the factors' bytes (the file's low-rank part)."""
    from bitdelta.format import read_header
    from bitdelta.lora_import import import_lora
    from bitdelta.testing.family import make_lora

    adapter = make_lora(args.base, work / "adapter", args.lora)
    out = import_lora(args.base, adapter, deltas / f"{LORA}.bitdelta.safetensors", variant=LORA)
    src = next((ROOT / "build" / "peer-src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    args.lora_gguf = work / "lora-f16.gguf"
    subprocess.run(
        [
            sys.executable,
            str(src / "convert_lora_to_gguf.py"),
            "--base",
            str(args.base),
            "--outtype",
            "f16",
            "--outfile",
            str(args.lora_gguf),
            str(adapter),
        ],
        env={**env, "PYTHONPATH": f"{src / 'gguf-py'}:{ROOT / 'build' / 'peer-tools'}"},
        check=True,
        capture_output=True,
    )
    return read_header(out).bytes_by_role()["lowrank"]


@dataclass
class WorkerProc:
    proc: subprocess.Popen
    address: str
    log_path: Path


def start_worker(
    base: Path, deltas: Path, dtype: str, threads: int, kv: str, logdir: Path, env: dict, extra: tuple[str, ...] = ()
) -> WorkerProc:
    from bitdelta.testing.cluster import free_port

    port = free_port()
    log_path = logdir / f"worker-{base.name}-{dtype}.log"
    cmd = [
        sys.executable,
        "-m",
        "services.gpu_worker",
        "--base",
        str(base),
        "--delta-dir",
        str(deltas),
        "--dtype",
        dtype,
        "--device",
        "cpu",
        "--kv-cache",
        kv,
        "--address",
        f"127.0.0.1:{port}",
        "--prefix-caching",  # every repetition computes its prompt, as llama.cpp's reset() does
        "false",
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    return WorkerProc(proc, f"127.0.0.1:{port}", log_path)


def wait_serving(w: WorkerProc, timeout: float = 300) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(w.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            if w.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not become SERVING; log: {w.log_path.read_text()[-3000:]}")
            time.sleep(0.3)


def generate_times(stub, model_id: str, prompt: str, n: int) -> list[tuple[float, int]]:
    """(arrival time (perf_counter), tokens in it) of each message of one greedy stream of exactly
    n tokens: a message carries every token ready when the previous write finished."""
    from bitdelta.common.v1 import generation_pb2 as gen_pb
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb

    sp = gen_pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    times = []
    for msg in stub.Generate(pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=sp), timeout=600):
        times.append((time.perf_counter(), len(msg.tokens)))
    return times


def decode_rate(stub, model_id: str, prompt: str, n: int) -> float:
    """Tokens/s of one greedy stream after its first message."""
    t = generate_times(stub, model_id, prompt, n)
    return sum(k for _, k in t[1:]) / (t[-1][0] - t[0][0])


def multi_rate(stub, models: list[str], prompt: str, n: int) -> float:
    """Tokens/s of the decode phase (after every stream's first message) of concurrent streams."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(models)) as ex:
        rs = list(ex.map(lambda m: generate_times(stub, m, prompt, n), models))
    t0 = max(r[0][0] for r in rs)
    t1 = max(r[-1][0] for r in rs)
    toks = sum(sum(k for t, k in r if t > t0) for r in rs)
    return toks / (t1 - t0)


def best_interleaved(runs: dict, reps: int) -> dict[str, float]:
    """The best of `reps` runs of each measurement, taken in turns (a, b, a, b, ...), so the ratio
    of two is not the ratio of a quiet moment and a busy one on a shared machine."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(reps):
        for k, run in runs.items():
            best[k] = max(best[k], run())
    return best


def prefill_s(stub, prompt: str, reps: int) -> float:
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        times = generate_times(stub, "", prompt, 1)
        best = min(best, times[0][0] - t)
    return best


def idle_rss(base: Path, deltas: Path, dtype: str, args, logdir: Path, env: dict, extra: tuple[str, ...] = ()) -> int:
    """VmRSS of an idle worker on `base` (started, serving, nothing asked of it yet)."""
    w = start_worker(base, deltas, dtype, args.threads, args.kv_cache, logdir, env, extra)
    try:
        wait_serving(w)
        time.sleep(1.0)
        return vm_rss(w.proc.pid)
    finally:
        w.proc.terminate()
        w.proc.wait(timeout=60)


def bench_worker(args, base, deltas, names, dtype, logdir, env) -> dict:
    import grpc

    from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc

    w = start_worker(base, deltas, dtype, args.threads, args.kv_cache, logdir, env)
    try:
        wait_serving(w)
        time.sleep(1.0)
        res = {"rss_idle": vm_rss(w.proc.pid)}
        with grpc.insecure_channel(w.address) as ch:
            stub = pb_grpc.GpuWorkerServiceStub(ch)
            generate_times(stub, "", DECODE_PROMPT, 4)  # first request: lazy set-up out of the numbers
            n_new = args.new_tokens
            runs = {"decode_tok_s": lambda: decode_rate(stub, "", DECODE_PROMPT, n_new)}
            if args.lora:
                generate_times(stub, LORA, DECODE_PROMPT, 2)  # load it
                runs["lora_tok_s"] = lambda: decode_rate(stub, LORA, DECODE_PROMPT, n_new)
            if dtype == "float32" or args.variants_bf16:
                for n in names:  # load them
                    generate_times(stub, n, DECODE_PROMPT, 2)
                mixed = [names[i % len(names)] for i in range(8)]
                runs["variant_tok_s"] = lambda: decode_rate(stub, names[0], DECODE_PROMPT, n_new)
                runs["base8_tok_s"] = lambda: multi_rate(stub, [""] * 8, DECODE_PROMPT, n_new)
                runs["mixed8_tok_s"] = lambda: multi_rate(stub, mixed, DECODE_PROMPT, n_new)
            res.update(best_interleaved(runs, args.reps))
            res["prefill_s"] = prefill_s(stub, PROMPT_WORDS * args.prompt_repeat, args.reps)
            if "variant_tok_s" in res:
                res["rss_after_variants"] = vm_rss(w.proc.pid)
        return res
    finally:
        w.proc.terminate()
        try:
            w.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.proc.kill()


def bench_peer(args, gguf: dict[str, Path], env: dict) -> dict:
    cfg = {
        "gguf": {k: str(v) for k, v in gguf.items()},
        "threads": args.threads,
        "reps": args.reps,
        "new_tokens": args.new_tokens,
        "long": PROMPT_WORDS * args.prompt_repeat,
        "short": DECODE_PROMPT,
        "lora": str(args.lora_gguf) if args.lora else None,
    }
    out = subprocess.run(
        [str(args.peer_python), "-c", PEER_SCRIPT, json.dumps(cfg)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp peer failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def round_values(r: dict, rnd: dict) -> dict[str, float]:
    """One round's numbers and ratios, its limits from its own best bandwidth sample. Keys per
    precision b (32, 16): w/p (worker, llama.cpp tok/s), lim, wpre/ppre (prefill s), pre (speed
    ratio), rss/prss (idle RSS), acc (the worker's account); the variant rows var and mix (fp32:
    no suffix, bf16: "16", measured with --variants-bf16), their limits var_lim and mix_lim (the
    weights' bytes ÷ those bytes plus the deltas'), and their ratios to those limits."""
    v: dict[str, float] = {}
    for b, dtype, peer, es in ((32, "float32", "f32", 4), (16, "bfloat16", "bf16", 2)):
        w, p = rnd["worker"][dtype], rnd["peer"][peer]
        weights = r["weights_fp32" if b == 32 else "weights_bf16"]
        lim = rnd["bandwidth"] / weights
        acc = sum(r["account"][dtype].values())
        v |= {f"w{b}": w["decode_tok_s"], f"p{b}": p["decode_tok_s"], f"lim{b}": lim}
        v |= {f"w{b}/p{b}": w["decode_tok_s"] / p["decode_tok_s"], f"w{b}/lim": w["decode_tok_s"] / lim}
        v |= {f"wpre{b}": w["prefill_s"], f"ppre{b}": p["prefill_s"], f"pre{b}": p["prefill_s"] / w["prefill_s"]}
        v |= {f"rss{b}": w["rss_idle"], f"prss{b}": p["rss_idle"], f"acc{b}": acc}
        v |= {f"rss{b}/p": w["rss_idle"] / p["rss_idle"], f"rss{b}/acc": w["rss_idle"] / acc}
        if "variant_tok_s" in w:  # fp32 always, bf16 with --variants-bf16
            sfx = "" if b == 32 else str(b)
            var, mix = w["variant_tok_s"] / w["decode_tok_s"], w["mixed8_tok_s"] / w["base8_tok_s"]
            var_lim, mix_lim = weights / (weights + r["delta_bytes"]), es / (es + 4 / 8)  # V = 4 variants
            v |= {f"var{sfx}": var, f"var{sfx}_lim": var_lim, f"var{sfx}/lim": var / var_lim}
            v |= {f"mix{sfx}": mix, f"mix{sfx}_lim": mix_lim, f"mix{sfx}/lim": mix / mix_lim}
        if "lora_tok_s" in w:  # --lora: each peer's LoRA stream ÷ its own base's
            lora, plora = w["lora_tok_s"] / w["decode_tok_s"], p["lora_tok_s"] / p["decode_tok_s"]
            lora_lim = weights / (weights + r["lora_bytes"])
            v |= {f"lora{b}": lora, f"plora{b}": plora, f"lora{b}_lim": lora_lim, f"lora{b}/lim": lora / lora_lim}
            v |= {
                f"wl{b}": w["lora_tok_s"],
                f"pl{b}": p["lora_tok_s"],
                f"wl{b}/pl{b}": w["lora_tok_s"] / p["lora_tok_s"],
            }
    w32 = rnd["worker"]["float32"]
    v["base8"], v["mixed8"], v["rss_var"] = w32["base8_tok_s"], w32["mixed8_tok_s"], w32["rss_after_variants"]
    return v


def table(r: dict) -> str:
    """Issue #23's table: each cell the median over the rounds, each ratio's range across them too."""
    import statistics

    per = [round_values(r, rnd) for rnd in r["rounds"]]
    med = {k: statistics.median(v[k] for v in per) for k in per[0]}

    def ratio(k: str, f: str = ".2f") -> str:
        lo, hi = min(v[k] for v in per), max(v[k] for v in per)
        return f"{med[k]:{f}}" if len(per) == 1 else f"{med[k]:{f}} ({lo:{f}}–{hi:{f}})"

    gb = lambda b: f"{b / 1e9:.2f} GB"
    rows = [
        "| | worker | llama.cpp | limit | worker ÷ llama.cpp | worker ÷ limit | target |",
        "|---|---|---|---|---|---|---|",
        f"| single-stream decode, fp32 | {med['w32']:.1f} tok/s | {med['p32']:.1f} tok/s | {med['lim32']:.1f} tok/s | "
        f"{ratio('w32/p32')} | {ratio('w32/lim')} | ≥ 1.0 and ≥ 0.85 |",
        f"| single-stream decode, bf16 | {med['w16']:.1f} tok/s | {med['p16']:.1f} tok/s | {med['lim16']:.1f} tok/s | "
        f"{ratio('w16/p16')} | {ratio('w16/lim')} | ≥ 1.0 and ≥ 0.85 |",
        f"| same, a variant (fp32) ÷ base | {ratio('var')} | – | {med['var_lim']:.2f} | – | {ratio('var/lim')} | "
        "≥ 0.95 × base |",
        f"| prefill of {r['rounds'][0]['peer']['f32']['prefill_tokens']} tokens, fp32 / bf16 | "
        f"{med['wpre32']:.2f} s / {med['wpre16']:.2f} s | {med['ppre32']:.2f} s / {med['ppre16']:.2f} s | – | "
        f"{ratio('pre32')} / {ratio('pre16')} (speed) | – | – |",
        f"| 8 streams over 4 variants ÷ 8 on the base (fp32) | {ratio('mix')} | – | {med['mix_lim']:.2f} | – | "
        f"{ratio('mix/lim')} | ≥ 0.9 |",
    ]
    if "var16" in med:
        rows += [
            f"| same, a variant (bf16) ÷ base | {ratio('var16')} | – | {med['var16_lim']:.2f} | – | "
            f"{ratio('var16/lim')} | ≥ 0.95 × base |",
            f"| 8 streams over 4 variants ÷ 8 on the base (bf16) | {ratio('mix16')} | – | {med['mix16_lim']:.2f} | – | "
            f"{ratio('mix16/lim')} | ≥ 0.9 |",
        ]
    for b, name in ((32, "fp32"), (16, "bf16")):
        if f"lora{b}" in med:
            rows.append(
                f"| a rank-{r['lora_rank']} LoRA adapter ({name}) ÷ base | {ratio(f'lora{b}')} "
                f"({med[f'wl{b}']:.1f} tok/s) | {ratio(f'plora{b}')} ({med[f'pl{b}']:.1f} tok/s) | "
                f"{med[f'lora{b}_lim']:.3f} | {ratio(f'wl{b}/pl{b}')} | {ratio(f'lora{b}/lim')} | – |"
            )
    rows += [
        f"| resident memory, base only, idle, fp32 | {gb(med['rss32'])} | {gb(med['prss32'])} | "
        f"{gb(med['acc32'])} (weights + KV + slot rows + fixed) | {ratio('rss32/p')} | {ratio('rss32/acc', '.3f')} | ≤ 1 |",
        f"| same, bf16 | {gb(med['rss16'])} | {gb(med['prss16'])} | {gb(med['acc16'])} | {ratio('rss16/p')} | "
        f"{ratio('rss16/acc', '.3f')} | ≤ 1 |",
    ]
    a32, a16 = r["account"]["float32"], r["account"]["bfloat16"]
    samples = "; ".join(
        f"round {i + 1}: {rnd['bandwidth'] / 1e9:.1f} of "
        + ", ".join(f"{b / 1e9:.1f}" for b in rnd["bandwidth_samples"])
        for i, rnd in enumerate(r["rounds"])
    )
    notes = (
        f"\n{len(per)} round(s), each a worker's fp32 and bf16 and llama.cpp's measures in turn, its limits from its own "
        f"best read bandwidth (GB/s, {r['threads']} thread(s): {samples}); a cell is the median over the rounds, "
        f"a ratio's range across them in brackets. Weights fp32 {gb(r['weights_fp32'])}, bf16 {gb(r['weights_bf16'])}; "
        f"delta {r['delta_bytes'] / 1e6:.1f} MB; KV pool {r['kv_bytes'] / 1e6:.0f} MB; slot α/norm rows of the default "
        f"1 GiB budget {a32['slot_rows'] / 1e6:.0f} MB (fp32); runtime fixed cost {gb(a32['fixed'])} / {gb(a16['fixed'])} "
        "(python, torch, gRPC, kernels, tokenizer: the idle RSS of the worker serving a one-layer model of width 8 with "
        f"the same tokenizer); 8 streams fp32: base {med['base8']:.1f} tok/s, 4 variants {med['mixed8']:.1f} tok/s; "
        f"worker RSS after serving 4 variants {gb(med['rss_var'])}\n"
    )
    return "\n".join(rows) + notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "data" / "base")
    ap.add_argument("--peer-python", type=Path, default=ROOT / "build" / "peer-venv" / "bin" / "python")
    ap.add_argument("--gguf-dir", type=Path, default=ROOT / "build" / "peer-gguf")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of both peers (1: a shared machine)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-repeat", type=int, default=18, help="the prefill prompt's sentence, this many times")
    ap.add_argument("--reps", type=int, default=5, help="best of this many runs per number (in turns)")
    ap.add_argument("--rounds", type=int, default=3, help="the whole measure this many times; the table's medians")
    ap.add_argument("--kv-cache", default="64MiB")
    ap.add_argument("--variants-bf16", action="store_true", help="the variant rows in bf16 too")
    ap.add_argument(
        "--lora", type=int, default=0, metavar="R", help="also a rank-R LoRA adapter's rows (both peers, fp32 and bf16)"
    )
    ap.add_argument("--out", type=Path, help="also write the table (and the raw numbers as .json) here")
    args = ap.parse_args(argv)
    import torch

    from bitdelta.testing.real import real_deltas_of
    from bitdelta.units import parse_bytes
    from services.gpu_worker.memory import account, with_fixed

    gguf = {"f32": args.gguf_dir / "base-f32.gguf", "bf16": args.gguf_dir / "base-bf16.gguf"}
    missing = [str(p) for p in (args.peer_python, *gguf.values()) if not p.exists()]
    if missing:
        log(f"missing {', '.join(missing)}: run `bash bench/peer_env.sh` first")
        return 2
    n = str(args.threads)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": n, "BITDELTA_CPU_PRECISION": "auto"}
    r: dict = {"threads": args.threads, "kv_bytes": parse_bytes(args.kv_cache)}
    bw = [read_bandwidth(args.threads)]  # sampled again after each peer: a round's best is its limit
    log(f"bandwidth {bw[-1] / 1e9:.1f} GB/s")
    real = real_deltas_of(args.base)
    with tempfile.TemporaryDirectory(prefix="peer-cpu-") as tmp:
        deltas = Path(tmp) / "deltas"
        names = make_deltas(real, deltas, 4)
        r["delta_bytes"] = next(deltas.iterdir()).stat().st_size
        if args.lora:
            r["lora_rank"], r["lora_bytes"] = args.lora, with_lora(args, Path(tmp), deltas, env)
        logdir = Path(tmp)
        empty = empty_base(args.base, Path(tmp) / "empty")
        r["account"] = {}
        for dtype in ("float32", "bfloat16"):  # the idle account, its fixed cost measured in this run
            dt = getattr(torch, dtype)
            rss = idle_rss(empty, deltas, dtype, args, logdir, env, EMPTY_FLAGS)
            acc = with_fixed(account(args.base, dt, r["kv_bytes"]), rss, account(empty, dt, EMPTY_KV, max_slots=1))
            r["account"][dtype] = dataclasses.asdict(acc)
        r["weights_fp32"], r["weights_bf16"] = r["account"]["float32"]["weights"], r["account"]["bfloat16"]["weights"]
        r["rounds"] = []
        for i in range(args.rounds):  # every ratio is taken within a round: a minute, not the whole run
            rnd: dict = {"worker": {}, "bandwidth_samples": bw if i == 0 else [read_bandwidth(args.threads)]}
            for dtype in ("float32", "bfloat16"):
                log(f"round {i + 1}/{args.rounds}: worker {dtype} ...")
                rnd["worker"][dtype] = bench_worker(args, args.base, deltas, names, dtype, logdir, env)
                log(json.dumps(rnd["worker"][dtype]))
                rnd["bandwidth_samples"].append(read_bandwidth(args.threads))
            log(f"round {i + 1}/{args.rounds}: llama.cpp ...")
            rnd["peer"] = bench_peer(args, gguf, env)
            log(json.dumps(rnd["peer"]))
            rnd["bandwidth_samples"].append(read_bandwidth(args.threads))
            rnd["bandwidth"] = max(rnd["bandwidth_samples"])
            r["rounds"].append(rnd)
    text = table(r)
    save_report(args.out, text, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
