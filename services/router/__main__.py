"""`python -m services.router --address HOST:PORT --workers HOST:PORT[,...] --delta-store HOST:PORT`"""

import asyncio
import logging

from services.router.config import RouterConfig
from services.router.server import serve


def main(argv=None) -> None:
    config = RouterConfig.main_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
