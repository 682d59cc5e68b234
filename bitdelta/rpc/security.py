"""Transport security and access control for every service, set up once here.

    @dataclass(frozen=True)
    class RouterConfig(ServiceConfig, TlsSettings, AuthSettings): ...   # --tls-ca/--tls-cert/--tls-key,
                                                                        # --tls-client-auth, --tokens-file
    server = create_server(addr, services, table, credentials=config.server_credentials(),
                           interceptors=[AuthInterceptor(names, config.tokens(), ROUTER_ROLES)])
    client = WorkerClient(addr, credentials=config.channel_credentials())    # presents our certificate
    client = RouterClient(addr, credentials=..., token="...")   # `bearer_interceptors` on its channel

TLS (`TlsSettings`): off unless `--tls-ca` is set. Then a service serves TLS with `--tls-cert` /
`--tls-key` and, unless `--no-tls-client-auth`, requires a client certificate signed by that CA
(mutual TLS); its own calls to other services verify them against the same CA and present the
same certificate. One CA, one certificate per service, SANs for every name it is called by
(`python -m bitdelta.rpc.certs` makes them for the tests and Kubernetes). `--health-address`
adds a plain-text port serving grpc.health.v1 alone, for probes that cannot present a certificate.

Bearer tokens (`AuthSettings`, `--tokens-file`): a JSON object, one entry per token:

    {"sha256:9f86d0...": {"name": "alice", "variants": ["coder", "base"]},
     "sha256:60303a...": {"name": "ops", "variants": "*", "admin": true}}

A key is `sha256:<hex of the token's sha256>` (what to store) or the token itself (demos only).
The token travels as the metadata `authorization: Bearer <token>` (what the gateway forwards from
HTTP). `AuthInterceptor` checks each domain method against a role table (`Role.PUBLIC`: no
token; `Role.USER`: any known token; `Role.ADMIN`: a token with `admin: true`): no or unknown
token -> UNAUTHENTICATED, a known token without the role -> PERMISSION_DENIED. The caller's
`Principal` is then `current_principal()` inside the servicer (the router checks variants with
it). Tokens are never logged nor echoed; the file is re-read when it changes (a rotated
Kubernetes Secret), a broken new version keeps the old table and logs why.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from bitdelta.rpc.config import ConfigError, check_address, check_files, setting
from bitdelta.rpc.errors import ServiceError

log = logging.getLogger("bitdelta.rpc.security")
AUTH_METADATA_KEY = "authorization"  # what the gateway forwards from HTTP's Authorization header
RELOAD_CHECK_S = 5.0  # how often the tokens file's mtime is looked at


# -- TLS -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes: the CA that signs every service (and client), and this party's certificate and key."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def load(cls, ca: Path | str, cert: Path | str | None = None, key: Path | str | None = None) -> TlsFiles:
        return cls(
            Path(ca).read_bytes(), Path(cert).read_bytes() if cert else None, Path(key).read_bytes() if key else None
        )

    def server_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("a TLS server needs its certificate and key")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=require_client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify the server against the CA; present our certificate when we have one (mutual TLS)."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


@dataclass(frozen=True, kw_only=True)  # keyword-only: a service's own required fields may follow
class TlsSettings:
    """Mixin for a service config: TLS for its server and for its calls to other services."""

    tls_ca: Path | None = setting(
        None,
        "PEM CA bundle: turns TLS on; peers (servers called, clients when "
        "--tls-client-auth) must have certificates it signed",
    )
    tls_cert: Path | None = setting(
        None, "PEM certificate (chain) this service serves with and presents to the services it calls"
    )
    tls_key: Path | None = setting(None, "PEM private key of --tls-cert")
    tls_client_auth: bool = setting(True, "with --tls-ca: require a client certificate signed by it (mutual TLS)")
    health_address: str = setting(
        "",
        "HOST:PORT serving grpc.health.v1 alone in plain text (Kubernetes' grpc "
        "probes cannot present a certificate); empty: none",
        check=lambda v: v and check_address(v),
    )

    @property
    def tls_on(self) -> bool:
        return self.tls_ca is not None

    def check_tls(self, needs_server_cert: bool = True) -> None:
        """Raise ConfigError for a partial TLS setting (call from the config's `check`)."""
        pre = getattr(self, "ENV_PREFIX", "")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"--tls-cert ({pre}TLS_CERT) and --tls-key ({pre}TLS_KEY) go together")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ConfigError(f"--tls-cert needs --tls-ca ({pre}TLS_CA): the CA that signed the other services")
        if self.tls_ca is not None and needs_server_cert and self.tls_cert is None:
            raise ConfigError(
                f"--tls-ca turns TLS on: give this service's --tls-cert and --tls-key ({pre}TLS_CERT, {pre}TLS_KEY) too"
            )
        check_files(self, "tls_ca", "tls_cert", "tls_key")

    def tls_files(self) -> TlsFiles | None:
        return TlsFiles.load(self.tls_ca, self.tls_cert, self.tls_key) if self.tls_on else None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: plain text (TLS off)."""
        files = self.tls_files()
        return files.server_credentials(self.tls_client_auth) if files else None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """For this service's calls to others; None: plain text (TLS off)."""
        files = self.tls_files()
        return files.channel_credentials() if files else None


# -- tokens ------------------------------------------------------------------------------------------
class Role(enum.IntEnum):
    PUBLIC = 0  # no token needed (the transport, mTLS when on, is the only gate)
    USER = 1  # any known token
    ADMIN = 2  # a token with "admin": true


@dataclass(frozen=True)
class Principal:
    """Who a valid token belongs to: its name (never the token), the models it may use, admin or not."""

    name: str
    variants: frozenset[str] | None  # None: every model ("*")
    admin: bool = False

    def may_use(self, model_id: str, is_base: bool = False) -> bool:
        """`model_id` is what the variant is called; the base is also allowed by the name "base"."""
        if self.variants is None:
            return True
        return model_id in self.variants or (is_base and "base" in self.variants)

    def shown_variants(self) -> str:
        return "every model" if self.variants is None else (", ".join(sorted(self.variants)) or "no model")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_tokens(text: str, where: str = "tokens file") -> dict[str, Principal]:
    """{sha256 hex of the token: Principal} from the JSON text of a tokens file; ValueError naming
    the entry (by its name or position, never its key) when malformed."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object {{token or 'sha256:<hex>': {{name, variants, admin}}}}")
    out: dict[str, Principal] = {}
    for i, (key, entry) in enumerate(raw.items()):
        label = f"{where}: entry #{i + 1}"
        if not isinstance(entry, dict):
            raise ValueError(f"{label}: must be an object {{name, variants, admin}}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{label}: 'name' must be a non-empty string")
        label = f"{where}: token {name!r}"
        extra = set(entry) - {"name", "variants", "admin"}
        if extra:
            raise ValueError(f"{label}: unknown fields {sorted(extra)} (name, variants, admin)")
        variants = entry.get("variants", [])
        if variants == "*":
            allowed = None
        elif isinstance(variants, list) and all(isinstance(v, str) and v for v in variants):
            allowed = frozenset(variants)
        else:
            raise ValueError(f"{label}: 'variants' must be \"*\" or a list of model names")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{label}: 'admin' must be true or false")
        if not isinstance(key, str) or not key:
            raise ValueError(f"{label}: empty token")
        if key.startswith("sha256:"):
            digest = key[7:].lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{label}: 'sha256:' must be followed by 64 hex digits")
        else:
            digest = token_digest(key)
        if digest in out:
            raise ValueError(f"{label}: the same token as {out[digest].name!r}")
        out[digest] = Principal(name, allowed, admin)
    return out


class TokenTable:
    """The tokens of a tokens file, re-read when the file changes (checked every `RELOAD_CHECK_S`)."""

    def __init__(self, path: Path | str | None = None, *, principals: Mapping[str, Principal] | None = None):
        self.path = Path(path) if path else None
        self._by_digest = dict(principals or {})
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        if self.path is not None:
            self._by_digest = parse_tokens(self.path.read_text(), str(self.path))
            self._stamp = self._stat()
            self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _maybe_reload(self) -> None:
        if self.path is None or time.monotonic() - self._checked < RELOAD_CHECK_S:
            return
        self._checked = time.monotonic()
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._by_digest = parse_tokens(self.path.read_text(), str(self.path))
            log.info("tokens file %s re-read: %d tokens", self.path, len(self._by_digest))
        except (OSError, ValueError) as e:
            log.error(
                "tokens file %s changed but cannot be used (keeping the previous %d tokens): %s",
                self.path,
                len(self._by_digest),
                e,
            )

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str) -> Principal | None:
        self._maybe_reload()
        return self._by_digest.get(token_digest(token))


@dataclass(frozen=True, kw_only=True)
class AuthSettings:
    """Mixin for a service config: the bearer tokens file (off when unset)."""

    tokens_file: Path | None = setting(
        None, "JSON file of bearer tokens {token or 'sha256:<hex>': {name, variants, admin}}; empty: no token checks"
    )

    def tokens(self) -> TokenTable | None:
        """The table (None: auth off); ConfigError naming the flag when the file is unusable."""
        if self.tokens_file is None:
            return None
        pre = getattr(self, "ENV_PREFIX", "")
        try:
            return TokenTable(self.tokens_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokens-file ({pre}TOKENS_FILE): {e}") from None


# -- the server interceptor --------------------------------------------------------------------------
_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("bitdelta_principal", default=None)


def current_principal() -> Principal | None:
    """The caller of the method running now (None: auth is off, or the method is PUBLIC)."""
    return _principal.get()


def bearer_token(metadata) -> str | None:
    """The token of `authorization: Bearer <token>`; '' for a malformed header; None when absent."""
    for k, v in metadata or ():
        if k.lower() == AUTH_METADATA_KEY:
            if isinstance(v, bytes):
                v = v.decode("latin-1")
            scheme, _, token = v.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthError(ServiceError):
    """A call without the right credentials: UNAUTHENTICATED or PERMISSION_DENIED."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def authorize(tokens: TokenTable, role: Role, metadata, what: str) -> Principal:
    """The caller's principal if it may call `what` with `role`; AuthError otherwise."""
    token = bearer_token(metadata)
    if token is None:
        raise AuthError(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{what} needs a bearer token: send the metadata '{AUTH_METADATA_KEY}: Bearer <token>' "
            f"(HTTP: the Authorization header)",
        )
    if not token:
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED, f"the '{AUTH_METADATA_KEY}' metadata must be 'Bearer <token>'")
    principal = tokens.lookup(token)
    if principal is None:
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED, f"{what}: the bearer token is not valid here")
    if role >= Role.ADMIN and not principal.admin:
        raise AuthError(
            grpc.StatusCode.PERMISSION_DENIED, f"{what} needs an admin token; token {principal.name!r} is not admin"
        )
    return principal


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of each call to `services`' methods against `roles` (method short
    name -> Role; others get `default`). Health and reflection are never checked. With `tokens`
    None (auth off) it passes everything."""

    def __init__(self, services, tokens: TokenTable | None, roles: Mapping[str, Role], default: Role = Role.PUBLIC):
        self.prefixes = tuple(f"/{s}/" for s in services)
        self.tokens, self.roles, self.default = tokens, dict(roles), default

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if self.tokens is None or handler is None or not method.startswith(self.prefixes):
            return handler
        short = method.rsplit("/", 1)[1]
        role = self.roles.get(short, self.default)
        if role == Role.PUBLIC:
            return handler
        what = f"{method.split('/')[1].rsplit('.', 1)[-1]}.{short}"
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        tokens = self.tokens

        def check(context) -> None:  # an AuthError carries its code to the error interceptor outside
            _principal.set(authorize(tokens, role, context.invocation_metadata(), what))

        def unary(fn):
            async def call(request, context):
                check(context)
                return await fn(request, context)

            return call

        def stream(fn):
            async def call(request, context):
                check(context)
                async for response in fn(request, context):
                    yield response

            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kw)


# -- the client side: a bearer token on every call ------------------------------------------------------
def _with_token(details: grpc.aio.ClientCallDetails, value: str) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*(tuple(details.metadata or ())))
    if AUTH_METADATA_KEY not in md:  # a per-call token (the gateway forwarding its caller's) wins
        md.add(AUTH_METADATA_KEY, value)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials, details.wait_for_ready)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, value: str):
        self.value = value

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.value), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, value: str):
        self.value = value

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.value), request)


class _TokenStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, value: str):
        self.value = value

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.value), request_iterator)


def bearer_interceptors(token: str) -> list:
    """Client interceptors that send `authorization: Bearer <token>` on every call."""
    value = f"Bearer {token}"
    return [_TokenUnaryUnary(value), _TokenUnaryStream(value), _TokenStreamUnary(value)]


__all__ = [
    "AUTH_METADATA_KEY",
    "AuthError",
    "AuthInterceptor",
    "AuthSettings",
    "Principal",
    "Role",
    "TlsFiles",
    "TlsSettings",
    "TokenTable",
    "authorize",
    "bearer_interceptors",
    "current_principal",
    "parse_tokens",
    "token_digest",
]
