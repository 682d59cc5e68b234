"""`python -m services.gpu_worker --base DIR [--delta-store HOST:PORT | --delta-dir DIR] ...`

With `--tensor-parallel N` it starts ranks 1..N-1 itself, or, under `torchrun --nproc-per-node N`,
every rank runs this and ranks 1..N-1 follow rank 0 (services/gpu_worker/parallel.py)."""

import os

# torch's CPU allocator backs every buffer of 2 MB or more (the base's weights, the KV pool, the slot
# stacks) with transparent huge pages when this is set: it aligns the buffer to 2 MB and madvises
# it. A decode step streams every weight once, and on 4 KB pages each page of that stream is a TLB
# miss: fp32 and bf16 SmolLM2-135M steps ran 3-10 % faster on 2 MB pages (docs/worker.md, "Memory").
# The RSS is the same (a buffer's tail short of 2 MB stays on 4 KB pages). Torch reads the variable
# once, at the process's first tensor, so it is set before any import that makes one; set it to 0
# to keep 4 KB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# oneDNN, which runs torch's bf16 GEMMs and the CPU prefill paths' fp32 ones (bitdelta_kernels/cpu_ops.mm_nt),
# compiles a kernel for every GEMM shape it meets (a new row count is a new shape) and keeps it in
# two caches, oneDNN's and ideep's, 1024 entries each by default at ~0.5 MB an entry: a process
# meeting 1600 shapes grew by 1.2 GB, and a worker's RSS kept growing for minutes under a mixed load.
# 32 entries each hold every weight shape of a few recent row counts and bound the growth to ~40-50
# MB (docs/worker.md, "Memory"); a miss compiles again, 0.3-1.3 ms. Read at the first oneDNN GEMM.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
os.environ.setdefault("LRU_CACHE_CAPACITY", "32")

import asyncio
import logging

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.server import serve


def main(argv=None) -> None:
    config = WorkerConfig.main_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.tensor_parallel > 1:  # under torchrun every rank runs this; ranks 1..N-1 follow rank 0
        from services.gpu_worker.parallel import Rendezvous, run_follower

        rv = Rendezvous.from_env()
        if rv is not None and rv.rank != 0:
            run_follower(config, rv)
            return
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
