"""`python -m services.gateway --address HOST:PORT --router HOST:PORT [--chat-template DIR|FILE]
[--generation-config auto|vllm|DIR|FILE]
[--https-cert PEM --https-key PEM [--https-client-ca PEM]]`"""

import logging
import signal
import sys

import uvicorn

from services.gateway.app import Templates, create_app
from services.gateway.chat import ChatTemplateError
from services.gateway.config import GatewayConfig
from services.gateway.generation_config import GenerationConfigError, GenerationConfigs


def main(argv=None) -> None:
    config = GatewayConfig.main_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        templates = Templates.from_config(config)
    except ChatTemplateError as e:
        print(f"gateway: bad configuration: --chat-template: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        generation = GenerationConfigs.from_config(config)
    except GenerationConfigError as e:
        print(f"gateway: bad configuration: --generation-config: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    host, port = config.host_port
    if config.https_on:  # the files were loaded once by config.check_https: a bad one has exited 2 already
        logging.getLogger("services.gateway").info(
            "HTTPS on %s:%d with %s%s",
            host,
            port,
            config.https_cert,
            f"; clients must present a certificate signed by {config.https_client_ca}"
            if config.https_client_ca
            else "",
        )
    # uvicorn on SIGTERM stops accepting, lets requests in flight finish for grace_s, then cancels them
    # (which cancels their router calls).
    # uvicorn re-raises the signal it caught once it has shut down; with this no-op handler in place
    # a graceful stop exits 0, like the other services.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        create_app(config, templates, generation),
        host=host,
        port=port,
        log_level=config.log_level.lower(),
        access_log=config.log_level == "DEBUG",
        timeout_graceful_shutdown=config.grace_s,
        lifespan="on",
        proxy_headers=False,
        **config.uvicorn_ssl(),
    )


if __name__ == "__main__":
    main()
