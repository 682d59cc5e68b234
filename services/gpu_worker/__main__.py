"""`python -m services.gpu_worker --base DIR [--delta-store HOST:PORT | --delta-dir DIR] ...`"""

import asyncio
import logging

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.server import serve


def main(argv=None) -> None:
    config = WorkerConfig.main_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
