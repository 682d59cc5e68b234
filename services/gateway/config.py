"""The gateway's one typed configuration (flags + `BITDELTA_GATEWAY_*` variables), parsed and
checked by the shared `bitdelta.rpc.config.ServiceConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from bitdelta.rpc.config import ConfigError, ServiceConfig, check_address, parse_list, parse_log_level, setting
from bitdelta.rpc.security import TlsSettings
from bitdelta.units import parse_bytes


def check_variant_templates(values: tuple[str, ...]) -> None:
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{v!r} must be VARIANT=FILE|DIR")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig, TlsSettings):
    """BitDelta gateway: the OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions)
    in front of a router.

    The --tls-* settings are for the gateway's calls to the router (verify it against --tls-ca; present
    --tls-cert/--tls-key when the router requires client certificates); HTTP itself is plain: terminate
    HTTPS in front of the gateway (ingress, load balancer)."""

    ENV_PREFIX: ClassVar[str] = "BITDELTA_GATEWAY_"
    PROG: ClassVar[str] = "python -m services.gateway"

    address: str = setting("[::]:8000", "HOST:PORT to listen on (HTTP)", check=check_address)
    router: str = setting("", "HOST:PORT of the router (gRPC)", check=check_address, required=True)
    chat_template: Path | None = setting(None, "the base's chat template: a tokenizer directory (chat_template.jinja "
                                               "or tokenizer_config.json), a tokenizer_config.json or a .jinja file; "
                                               "without one, /v1/chat/completions answers 400")
    variant_chat_templates: tuple[str, ...] = setting((), "VARIANT=FILE|DIR,... : variants with a template of their "
                                                          "own (the others use --chat-template)",
                                                      parse=parse_list, check=check_variant_templates)
    owned_by: str = setting("bitdelta", "the `owned_by` of every model in /v1/models")
    request_timeout_s: float = setting(600.0, "deadline of one generation at the router, seconds (beyond: 504)")
    call_timeout_s: float = setting(10.0, "deadline of the router's ListModels, seconds")
    completion_default_max_tokens: int = setting(16, "max_tokens of a /v1/completions request that sets none "
                                                     "(OpenAI's default is 16); chat uses the router's default")
    max_body_bytes: int = setting(4 << 20, "largest request body; beyond: 413", parse=parse_bytes)
    grace_s: float = setting(10.0, "SIGTERM: requests in flight get this long to finish")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR", parse=parse_log_level)

    def check(self) -> None:
        self.check_tls(needs_server_cert=False)
        for name in ("request_timeout_s", "call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{self.flag_of(name)} must be > 0, got {getattr(self, name)}")
        for name in ("completion_default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.flag_of(name)} must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ConfigError(f"{self.flag_of('grace_s')} must be >= 0, got {self.grace_s}")

    @property
    def host_port(self) -> tuple[str, int]:
        """(host, port) for the HTTP server: "[::]:8000" -> ("::", 8000)."""
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)

    def variant_templates(self) -> dict[str, Path]:
        return {name: Path(path).expanduser() for name, _, path in (v.partition("=") for v in self.variant_chat_templates)}
