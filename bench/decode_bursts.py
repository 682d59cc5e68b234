"""What decode bursts (`--decode-burst-ms`) save: one greedy stream's decode tokens/s on the real
SmolLM2-135M over gRPC, a worker with bursts against one with single steps (`--decode-burst-ms 0`)
in the same run.

Starts both workers as processes on loopback (one thread each, `OMP_NUM_THREADS=1`, the same base,
dtype and one real delta), and measures them in turns, `--reps` streams of `--new-tokens` each
(`bench/peer_cpu.py`'s decode measure: tokens after the first message ÷ their time), per dtype.
Prints each side's best and median and the ratio bursts ÷ single steps of both.

    python bench/decode_bursts.py [--dtypes float32 bfloat16] [--reps 7] [--new-tokens 64] [--burst-ms 100] \
        [--out bench/results/decode_bursts_cpu_<date>.txt]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import peer_cpu  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / "data" / "base")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--burst-ms", default="100")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import grpc

    from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
    from bitdelta.testing.real import real_deltas_of

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "BITDELTA_CPU_PRECISION": "auto"}
    lines = [f"# one greedy stream, {args.new_tokens} new tokens, best / median of {args.reps} in turns; 1 thread"]
    with tempfile.TemporaryDirectory(prefix="decode-bursts-") as tmp:
        deltas = Path(tmp) / "deltas"
        peer_cpu.make_deltas(real_deltas_of(args.base), deltas, 1)
        for dtype in args.dtypes:
            sides = {"single steps": "0", "bursts": args.burst_ms}
            workers = {
                name: peer_cpu.start_worker(
                    args.base, deltas, dtype, 1, "64MiB", Path(tmp), env, ("--decode-burst-ms", ms)
                )
                for name, ms in sides.items()
            }
            try:
                for w in workers.values():
                    peer_cpu.wait_serving(w)
                chans = {n: grpc.insecure_channel(w.address) for n, w in workers.items()}
                stubs = {n: pb_grpc.GpuWorkerServiceStub(c) for n, c in chans.items()}
                for s in stubs.values():
                    peer_cpu.generate_times(s, "", peer_cpu.DECODE_PROMPT, 4)  # lazy set-up out of the numbers
                rates: dict[str, list[float]] = {n: [] for n in sides}
                for _ in range(args.reps):
                    for n, s in stubs.items():
                        rates[n].append(peer_cpu.decode_rate(s, "", peer_cpu.DECODE_PROMPT, args.new_tokens))
                for c in chans.values():
                    c.close()
            finally:
                for w in workers.values():
                    w.proc.terminate()
                    w.proc.wait(timeout=60)
            best = {n: max(r) for n, r in rates.items()}
            med = {n: statistics.median(r) for n, r in rates.items()}
            for n in sides:
                lines.append(
                    f"{dtype} {n} (--decode-burst-ms {sides[n]}): best {best[n]:.1f} tok/s, median {med[n]:.1f}"
                )
            lines.append(
                f"{dtype} bursts ÷ single steps: best {best['bursts'] / best['single steps']:.3f}, "
                f"median {med['bursts'] / med['single steps']:.3f}"
            )
            print("\n".join(lines[-3:]), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
