"""The router's one typed configuration (flags + `BITDELTA_ROUTER_*` variables), parsed and
checked by the shared `bitdelta.rpc.config.ServiceConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bitdelta.rpc.config import (
    ConfigError,
    ProcessSettings,
    ServiceConfig,
    check_address,
    check_addresses,
    parse_list,
    setting,
)
from bitdelta.rpc.security import AuthSettings, TlsSettings
from bitdelta.units import parse_bytes


@dataclass(frozen=True)
class RouterConfig(ServiceConfig, ProcessSettings, TlsSettings, AuthSettings):
    """BitDelta router: one public Generate for the base and every variant, over several workers."""

    ENV_PREFIX: ClassVar[str] = "BITDELTA_ROUTER_"
    PROG: ClassVar[str] = "python -m services.router"

    address: str = setting("[::]:50051", "HOST:PORT to listen on", check=check_address)
    workers: tuple[str, ...] = setting(
        (), "worker addresses HOST:PORT, comma-separated", parse=parse_list, check=check_addresses, required=True
    )
    delta_store: str = setting(
        "", "HOST:PORT of the delta store (the registry of variants)", check=check_address, required=True
    )
    max_in_flight_per_worker: int = setting(64, "requests the router keeps running on one worker at once")
    max_queue: int = setting(256, "requests waiting for a worker, in total; beyond: RESOURCE_EXHAUSTED")
    max_queue_per_variant: int = setting(64, "requests waiting for a worker, per variant; beyond: RESOURCE_EXHAUSTED")
    max_prompt_bytes: int = setting(
        1 << 20, "largest prompt in UTF-8 bytes; beyond: INVALID_ARGUMENT", parse=parse_bytes
    )
    max_new_tokens_limit: int = setting(4096, "largest max_new_tokens a request may ask for")
    poll_s: float = setting(1.0, "seconds between Status polls of each worker")
    refresh_s: float = setting(5.0, "seconds between refreshes of the variant list from the delta store")
    call_timeout_s: float = setting(5.0, "deadline of the router's own calls (Status, List), seconds")
    request_timeout_s: float = setting(600.0, "deadline of a Generate whose client set none, seconds")
    stream_max_tokens: int = setting(
        0,
        "most tokens in one Generate stream message; 0: every token ready when the message is written "
        "(1: one message per token, the wire's old behaviour, for comparison)",
    )

    def check(self) -> None:
        self.check_process()
        self.check_tls()
        self.tokens()  # a tokens file that cannot be used fails at start, naming the flag
        if not self.workers:
            raise ConfigError(f"{self.flag_of('workers')} needs at least one HOST:PORT")
        if len(set(self.workers)) != len(self.workers):
            raise ConfigError(f"{self.flag_of('workers')} names a worker twice: {','.join(self.workers)}")
        for name in ("max_in_flight_per_worker", "max_prompt_bytes", "max_new_tokens_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.flag_of(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queue", "max_queue_per_variant", "stream_max_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.flag_of(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("poll_s", "refresh_s", "call_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{self.flag_of(name)} must be > 0, got {getattr(self, name)}")
