"""The gateway's one typed configuration (flags + `BITDELTA_GATEWAY_*` variables), parsed and
checked by the shared `bitdelta.rpc.config.ServiceConfig`."""

from __future__ import annotations

import importlib.util
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from bitdelta.rpc.config import (
    ConfigError,
    ServiceConfig,
    check_address,
    check_files,
    parse_list,
    parse_log_level,
    setting,
)
from bitdelta.rpc.security import TlsSettings
from bitdelta.units import parse_bytes
from services.gateway.chat import CONTENT_FORMATS
from services.gateway.reasoning import PARSERS


def check_variant_files(values: tuple[str, ...]) -> None:
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{v!r} must be VARIANT=FILE|DIR")


def _check_content_format(value: str) -> None:
    if value not in CONTENT_FORMATS:
        raise ValueError(f"must be one of {', '.join(CONTENT_FORMATS)}")


def _check_reasoning_parser(value: str) -> None:
    if value not in PARSERS:
        raise ValueError(f"must be one of {', '.join(PARSERS)}")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig, TlsSettings):
    """BitDelta gateway: the OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions)
    in front of a router.

    Two separate TLS settings: --https-cert/--https-key/--https-client-ca are the gateway's own HTTP
    listener (HTTPS to its clients, optionally requiring client certificates); --tls-* are the gateway's
    calls to the router (verify it against --tls-ca; present --tls-cert/--tls-key when the router requires
    client certificates). Without --https-cert the listener is plain HTTP."""

    ENV_PREFIX: ClassVar[str] = "BITDELTA_GATEWAY_"
    PROG: ClassVar[str] = "python -m services.gateway"

    address: str = setting("[::]:8000", "HOST:PORT to listen on (HTTP; HTTPS with --https-cert)", check=check_address)
    router: str = setting("", "HOST:PORT of the router (gRPC)", check=check_address, required=True)
    chat_template: Path | None = setting(
        None,
        "the base's chat template: a tokenizer directory (chat_template.jinja "
        "or tokenizer_config.json), a tokenizer_config.json or a .jinja file; "
        "without one, /v1/chat/completions answers 400",
    )
    variant_chat_templates: tuple[str, ...] = setting(
        (),
        "VARIANT=FILE|DIR,... : these variants' templates, over their deltas' own (the others: their delta's, "
        "else --chat-template)",
        parse=parse_list,
        check=check_variant_files,
    )
    chat_template_content_format: str = setting(
        "auto",
        "how a message's content reaches the chat template, as vLLM's flag: `string` (text parts joined by "
        "newlines), `openai` (a list of {type: text, text} parts), or `auto` (openai where the template loops "
        "over a message's content)",
        check=_check_content_format,
    )
    tokenizer: Path | None = setting(
        None,
        "the base's directory (tokenizer.json; config.json for max_model_len), for /tokenize and "
        "/detokenize; without it they answer 400",
    )
    generation_config: str = setting(
        "auto",
        "sampling defaults of requests that leave them unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty; chat's max_tokens from max_new_tokens), as vLLM's --generation-config: "
        "`auto`, the base's generation_config.json (in --tokenizer's directory, else --chat-template's) "
        "when it has one; `vllm`, none (neutral values); or a generation_config.json or its directory",
    )
    variant_generation_configs: tuple[str, ...] = setting(
        (),
        "VARIANT=FILE|DIR,... : these variants' generation configs, over their deltas' own (the others: their "
        "delta's, else the base's)",
        parse=parse_list,
        check=check_variant_files,
    )
    model_refresh_s: float = setting(
        5.0,
        "how long a variant's own chat template and sampling defaults (its delta's, from the router's "
        "ListModels) are kept before the gateway asks again",
    )
    owned_by: str = setting("bitdelta", "the `owned_by` of every model in /v1/models")
    reasoning_parser: str | None = setting(
        None,
        "as vLLM's flag: a thinking model's <think> … </think> answered as chat's `reasoning`, apart from "
        "its content: deepseek_r1 (DeepSeek-R1 and its distills, QwQ) or qwen3",
        check=_check_reasoning_parser,
    )
    lora_base: Path | None = setting(
        None,
        "the base checkpoint's directory: turns on vLLM's runtime /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (PEFT adapters imported as `bitdelta import-lora` does, in a child process "
        "that needs torch, and put into --delta-store); without it they answer 404, as vLLM's without "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    )
    lora_root: Path | None = setting(
        None, "with --lora-base: the directory a load's lora_path must lie under (links resolved)"
    )
    delta_store: str | None = setting(
        None,
        "with --lora-base: HOST:PORT of the delta store the adapters go into, called with each caller's "
        "token (--tls-* as for the router)",
        check=check_address,
    )
    lora_timeout_s: float = setting(
        600.0, "with --lora-base: deadline of one adapter's import, and again of the router listing it"
    )
    responses_store: int = setting(
        0,
        "how many /v1/responses answers the gateway keeps in memory (the least recently used dropped) for "
        "previous_response_id and GET / DELETE /v1/responses/{id}, as vLLM's VLLM_ENABLE_RESPONSES_API_STORE; "
        "0: none (`store` is answered false, previous_response_id refused)",
    )
    responses_store_bytes: int = setting(
        256 << 20, "with --responses-store: the most bytes (their JSON) the kept answers take", parse=parse_bytes
    )
    request_timeout_s: float = setting(600.0, "deadline of one generation at the router, seconds (beyond: 504)")
    call_timeout_s: float = setting(10.0, "deadline of the router's ListModels, seconds")
    completion_default_max_tokens: int = setting(
        16,
        "max_tokens of a /v1/completions request that sets none "
        "(OpenAI's default is 16); chat uses the router's default",
    )
    max_body_bytes: int = setting(4 << 20, "largest request body; beyond: 413", parse=parse_bytes)
    grace_s: float = setting(10.0, "SIGTERM: requests in flight get this long to finish")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR", parse=parse_log_level)
    # TlsSettings' --tls-* again, with help that says they are the gateway -> router hop
    tls_ca: Path | None = setting(
        None,
        "calls to the router (gRPC, not the HTTP listener: see --https-*): PEM CA "
        "bundle the router's certificate must be signed by; turns TLS to the router on",
    )
    tls_cert: Path | None = setting(
        None,
        "calls to the router: PEM certificate (chain) presented to it when it "
        "requires client certificates (the HTTP listener's is --https-cert)",
    )
    tls_key: Path | None = setting(None, "calls to the router: PEM private key of --tls-cert")
    tls_client_auth: bool = setting(
        True, "no effect on the gateway (it serves no gRPC; for HTTPS client certificates see --https-client-ca)"
    )
    # the HTTP listener's own TLS (clients -> gateway); not the --tls-* ones (gateway -> router)
    https_cert: Path | None = setting(
        None,
        "PEM certificate (chain) the HTTP listener serves HTTPS with, to the "
        "gateway's clients; with --https-key. (--tls-cert is for the calls to "
        "the router)",
    )
    https_key: Path | None = setting(None, "PEM private key of --https-cert (unencrypted)")
    https_client_ca: Path | None = setting(
        None,
        "PEM CA bundle: with --https-cert, HTTPS clients must present a "
        "certificate it signed (mutual TLS); empty: no client certificates "
        "asked. (--tls-ca is for the calls to the router)",
    )

    def check(self) -> None:
        self.check_tls(needs_server_cert=False)
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ConfigError(f"{self.flag_of('tokenizer')} {self.tokenizer}: no tokenizer.json in it")
        self.check_https()
        for name in ("request_timeout_s", "call_timeout_s", "model_refresh_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{self.flag_of(name)} must be > 0, got {getattr(self, name)}")
        for name in ("completion_default_max_tokens", "max_body_bytes", "responses_store_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.flag_of(name)} must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ConfigError(f"{self.flag_of('grace_s')} must be >= 0, got {self.grace_s}")
        if self.responses_store < 0:
            raise ConfigError(f"{self.flag_of('responses_store')} must be >= 0, got {self.responses_store}")
        self.check_lora()

    def check_lora(self) -> None:
        if self.lora_base is None:
            for name in ("lora_root", "delta_store"):
                if getattr(self, name):
                    raise ConfigError(f"{self.flag_of(name)} needs {self.flag_of('lora_base')}")
            return
        if not (Path(self.lora_base) / "config.json").is_file():
            raise ConfigError(f"{self.flag_of('lora_base')} {self.lora_base}: no config.json in it")
        if self.lora_root is None or not Path(self.lora_root).is_dir():
            raise ConfigError(f"{self.flag_of('lora_base')} needs {self.flag_of('lora_root')}, a directory")
        if not self.delta_store:
            raise ConfigError(f"{self.flag_of('lora_base')} needs {self.flag_of('delta_store')}")
        if importlib.util.find_spec("torch") is None:
            raise ConfigError(
                f"{self.flag_of('lora_base')} needs torch in the gateway's Python (an import reads the base); "
                "the torch-free gateway serves adapters imported with `bitdelta import-lora` instead"
            )
        if not self.lora_timeout_s > 0:
            raise ConfigError(f"{self.flag_of('lora_timeout_s')} must be > 0, got {self.lora_timeout_s}")

    def check_https(self) -> None:
        """ConfigError naming the flag for a partial HTTPS setting, or a file that is missing or does not
        load as what it should be (the same loads uvicorn does at start, so it cannot fail later)."""
        cert, key, ca = self.https_cert, self.https_key, self.https_client_ca
        if (cert is None) != (key is None):
            given, missing = ("https_cert", "https_key") if key is None else ("https_key", "https_cert")
            raise ConfigError(
                f"{self.flag_of(given)} needs {self.flag_of(missing)}: the HTTPS certificate and its key go together"
            )
        if ca is not None and cert is None:
            raise ConfigError(
                f"{self.flag_of('https_client_ca')} needs {self.flag_of('https_cert')} and "
                f"{self.flag_of('https_key')}: client certificates are asked for over HTTPS only"
            )
        check_files(self, "https_cert", "https_key", "https_client_ca")
        if cert is None:
            return
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_verify_locations(cafile=str(cert))  # parses every certificate in the file, nothing else
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ConfigError(f"{self.flag_of('https_cert')} {cert}: not a PEM certificate ({_reason(e)})") from None

        def no_password():
            raise ValueError("the key is encrypted; give an unencrypted key")

        try:
            ctx.load_cert_chain(str(cert), str(key), password=no_password)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ConfigError(
                f"{self.flag_of('https_key')} {key}: not the PEM private key of "
                f"{self.flag_of('https_cert')} ({_reason(e)})"
            ) from None
        if ca is not None:
            try:
                ctx.load_verify_locations(cafile=str(ca))
            except (ssl.SSLError, OSError, ValueError) as e:
                raise ConfigError(
                    f"{self.flag_of('https_client_ca')} {ca}: not a PEM CA bundle ({_reason(e)})"
                ) from None

    @property
    def https_on(self) -> bool:
        return self.https_cert is not None

    def uvicorn_ssl(self) -> dict:
        """uvicorn.run's TLS keywords: {} for plain HTTP."""
        if not self.https_on:
            return {}
        out = {"ssl_certfile": str(self.https_cert), "ssl_keyfile": str(self.https_key)}
        if self.https_client_ca is not None:
            out |= {"ssl_ca_certs": str(self.https_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return out

    @property
    def host_port(self) -> tuple[str, int]:
        """(host, port) for the HTTP server: "[::]:8000" -> ("::", 8000)."""
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)

    def variant_templates(self) -> dict[str, Path]:
        return _variant_paths(self.variant_chat_templates)

    def variant_generation_config_paths(self) -> dict[str, Path]:
        return _variant_paths(self.variant_generation_configs)


def _variant_paths(values: tuple[str, ...]) -> dict[str, Path]:
    """VARIANT=PATH,... -> {variant: path}."""
    return {name: Path(path).expanduser() for name, _, path in (v.partition("=") for v in values)}


def _reason(e: Exception) -> str:
    """OpenSSL's reason (e.g. NO_CERTIFICATE_OR_CRL_FOUND, KEY_VALUES_MISMATCH) or the message."""
    if isinstance(e, ssl.SSLError):
        if e.reason:
            return f"{e.library}: {e.reason}" if e.library else e.reason
        if "PEM lib" in str(e):
            return "no PEM private key in it"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
