"""Errors across service boundaries: one status code per failure, kept across hops.

Every service's domain errors are one family, `ServiceError`: each class names
the status code it answers with (`code = grpc.StatusCode.NOT_FOUND`), and may
carry trailing metadata (`trailers`). The server's one interceptor turns any
exception into a status code through `status_of(e, table)`:

1. a `ServiceError` answers with its `code` — this is also how a downstream
   status survives a hop: a client raises `RpcError` (a `ServiceError` whose
   code is the one the callee returned), the service lets it propagate (or
   wraps it in a domain error that copies the code), and the caller upstream
   sees the same code. A store-side INVALID_ARGUMENT is never turned into a
   retryable UNAVAILABLE;
2. otherwise (exceptions of the core and standard libraries, which know no
   gRPC) the first type in the service's table that matches;
3. otherwise INTERNAL.

Messages echo what the caller sent, so they are clipped (`clip`): a 20,000
character name must give INVALID_ARGUMENT, not a "metadata size exceeds
limit" from the transport.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

import grpc

MAX_MESSAGE_CHARS = 1024  # status details are sent as metadata (8 KiB limit by default)
MAX_ECHO_CHARS = 80  # how much of a caller's value an error message repeats

StatusTable = Mapping[type, grpc.StatusCode]  # exception types outside the ServiceError family -> code
NO_TABLE: StatusTable = MappingProxyType({})

# Codes after which the same request may succeed elsewhere or later.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


class ServiceError(Exception):
    """Base of every service's domain errors. A subclass names its status code; an instance may
    set its own (`RpcError`: the callee's). `trailers` travel as the status's trailing metadata."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    trailers: Mapping[str, str] = MappingProxyType({})


class RpcError(ServiceError):
    """A call to another service failed. `code` is the status it returned (kept upstream),
    `service` which service, `details` its message, `trailers` its trailing metadata."""

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode,
        *,
        service: str = "",
        details: str = "",
        trailers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.code, self.service, self.details = code, service, details
        self.trailers = dict(trailers or {})

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


def from_aio_error(
    e: grpc.aio.AioRpcError, service: str, what: str, types: Mapping[grpc.StatusCode, type[RpcError]] | None = None
) -> RpcError:
    """An `RpcError` (or the subclass `types` names for its code) for a failed call."""
    code = e.code()
    trailers = {k: v for k, v in (e.trailing_metadata() or ()) if isinstance(v, str)}
    cls = (types or {}).get(code, RpcError)
    return cls(
        f"{service} {what}: {code.name}: {e.details()}",
        code,
        service=service,
        details=e.details() or "",
        trailers=trailers,
    )


def status_of(e: BaseException, table: StatusTable = NO_TABLE) -> grpc.StatusCode:
    """The status code of any exception a service raises (see the module docstring)."""
    if isinstance(e, ServiceError):
        return e.code
    for t, c in table.items():
        if isinstance(e, t):
            return c
    return grpc.StatusCode.INTERNAL


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` shortened to `limit` characters for an error message (repr-quoted, with its length)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


# A network address in a message: gRPC's resolver prefixes (ipv4:, dns:///, unix:), an IPv4 or
# bracketed IPv6 address (a colon inside: "tools[0]" is no address) with or without a port, a
# URL's host, or a host name with a port of 4 or 5 digits (a letter first: "12:30" and a model id
# like "qwen:7" are left alone).
_SCHEME = r"(?:(?<![\w-])(?:ipv4|ipv6|dns|unix|unix-abstract|vsock):(?://[^/\s]*/)?)"
_ADDRESS = re.compile(
    rf"{_SCHEME}?(?:\d{{1,3}}(?:\.\d{{1,3}}){{3}}(?::\d{{1,5}})?"
    rf"|\[[0-9A-Fa-f]*:[0-9A-Fa-f:.%\w]*\](?::\d{{1,5}})?"
    rf"|(?<=://)[\w.-]+(?::\d{{1,5}})?"
    rf"|(?<![\w.-])[A-Za-z][\w-]*(?:\.[\w-]+)*:\d{{4,5}}\b)"
    rf"|{_SCHEME}[^\s:;,)]+"
)
REDACTED = "<internal address>"


def without_addresses(message: str) -> str:
    """`message` with every network address replaced by `REDACTED`: what a public service (the
    router, the gateway) says to its callers. A worker's "delta store 10.0.0.7:50051 Fetch('v0'):
    UNAVAILABLE: ... ipv4:10.0.0.7:50051: Connection refused" keeps its meaning, not the
    deployment's layout; the service's log keeps the whole message."""
    return _ADDRESS.sub(REDACTED, message)


def clip_message(message: str) -> str:
    """A status message short enough to travel as metadata."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 20] + f"… [{len(message)} chars]"


def metadata_value(text: str, limit: int = 256) -> str:
    """`text` as a valid gRPC metadata value: printable ASCII only (anything else escaped), clipped.
    A trailer naming, say, a tensor read from a corrupted header would otherwise make the whole
    status an INTERNAL "Invalid metadata"."""
    out = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in str(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."
