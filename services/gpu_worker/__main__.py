"""`python -m services.gpu_worker --base DIR [--delta-store HOST:PORT | --delta-dir DIR] ...`

With `--tensor-parallel N` it starts ranks 1..N-1 itself, or, under `torchrun --nproc-per-node N`,
every rank runs this and ranks 1..N-1 follow rank 0 (services/gpu_worker/parallel.py)."""

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
