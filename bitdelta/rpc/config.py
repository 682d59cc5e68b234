"""One way to configure a service: a typed, frozen dataclass -> flags + environment + a start-up check.

    @dataclass(frozen=True)
    class RouterConfig(ServiceConfig):
        ENV_PREFIX: ClassVar[str] = "BITDELTA_ROUTER_"
        PROG: ClassVar[str] = "python -m services.router"
        address: str = setting("[::]:50051", "HOST:PORT to listen on", check=check_address)
        workers: tuple[str, ...] = setting((), "worker addresses, comma-separated", required=True)

        def check(self) -> None:        # cross-field rules; raise ConfigError
            ...

    config = RouterConfig.from_args(argv)    # ConfigError with the flag and variable named
    config = RouterConfig.main_args()        # the same; prints the error and exits 2

Every field `foo_bar` is the flag `--foo-bar` and the variable `<ENV_PREFIX>FOO_BAR`; a flag wins
over the variable, the variable over the default. Values are parsed by the field's type (str, int,
float, bool, Path, tuple[str, ...] as a comma-separated list, `X | None`) or by `parse=`
(e.g. `bitdelta.units.parse_bytes`). Booleans take `--flag`, `--no-flag` or `--flag=false`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="ServiceConfig")
ADDRESS_RE = re.compile(r"(\[[0-9a-fA-F:.]*\]|[\w.-]+):\d{1,5}")


class ConfigError(ValueError):
    """A bad setting; the message names the flag and the environment variable."""


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    parse: Callable[[str], Any] | None = None,
    check: Callable[[Any], None] | None = None,
    required: bool = False,
):
    """A config field: its default, help text, optional parser for text values and a per-value check
    (raise ValueError with the reason)."""
    meta = {"help": help, "parse": parse, "check": check, "required": required}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or frozenset default in a frozen config")
    return dataclasses.field(default=default, metadata=meta)


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def check_files(config, *names: str) -> None:
    """ConfigError naming the flag (and its variable) of each setting in `names` that is set to a path
    that is not a file."""
    pre = getattr(config, "ENV_PREFIX", "")
    for name in names:
        p = getattr(config, name)
        if p is not None and not Path(p).is_file():
            raise ConfigError(f"--{name.replace('_', '-')} ({pre}{name.upper()}) {p}: no such file")


def check_address(value: str) -> None:
    if not ADDRESS_RE.fullmatch(value):
        raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:50051 or [::]:50051")


def check_addresses(values: Sequence[str]) -> None:
    for v in values:
        if not ADDRESS_RE.fullmatch(v):
            raise ValueError(f"{v!r} must be HOST:PORT")


def parse_log_level(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
    return text.upper()


def _parser_for(tp: Any) -> tuple[Callable[[str], Any], bool]:
    """(parse text -> value, is_bool) for a field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _parser_for(args[0])
    if tp is bool:
        return parse_bool, True
    if tp is Path:
        return lambda v: Path(v).expanduser(), False
    if origin is tuple:
        return parse_list, False
    if tp in (str, int, float):
        return tp, False
    raise TypeError(f"no parser for config type {tp!r}: pass parse=")


class ServiceConfig:
    """Base of the services' configs (frozen dataclasses): `from_args` and `main_args`."""

    ENV_PREFIX: ClassVar[str] = ""
    PROG: ClassVar[str] = ""

    def check(self) -> None:
        """Cross-field rules, run by `from_args` after every value parsed; raise ConfigError."""

    def flag_of(self, name: str) -> str:
        return f"--{name.replace('_', '-')} ({self.ENV_PREFIX}{name.upper()})"

    @classmethod
    def from_args(cls: type[C], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> C:
        env = os.environ if env is None else env
        hints = typing.get_type_hints(cls)
        p = argparse.ArgumentParser(
            prog=cls.PROG or None,
            description=(cls.__doc__ or "").split("\n")[0],
            epilog=f"Every flag --foo-bar also reads {cls.ENV_PREFIX}FOO_BAR.",
        )
        fields = [f for f in dataclasses.fields(cls) if f.init]
        for f in fields:
            flag = "--" + f.name.replace("_", "-")
            default = "" if f.default is dataclasses.MISSING else f" (default {_show(f.default)})"
            h = f"{f.metadata.get('help', '')}{default}; env {cls.ENV_PREFIX}{f.name.upper()}"
            if _parser_for(hints[f.name])[1]:
                p.add_argument(flag, dest=f.name, nargs="?", const="true", metavar="BOOL", help=h)
                p.add_argument(
                    "--no-" + flag[2:], dest=f.name, action="store_const", const="false", help=argparse.SUPPRESS
                )
            else:
                p.add_argument(flag, dest=f.name, metavar=f.name.upper(), help=h)
        args = vars(p.parse_args(argv))
        values = {}
        for f in fields:
            where = f"--{f.name.replace('_', '-')} (or {cls.ENV_PREFIX}{f.name.upper()})"
            raw = args.get(f.name)
            if raw is None:
                raw = env.get(cls.ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                if f.default is dataclasses.MISSING or f.metadata.get("required"):
                    raise ConfigError(f"{where} is required: {f.metadata.get('help', '')}")
                continue
            parse = f.metadata.get("parse") or _parser_for(hints[f.name])[0]
            try:
                value = parse(raw)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{where} = {raw!r}: {e}") from None
            values[f.name] = value
        for f in fields:
            chk = f.metadata.get("check")
            value = values.get(f.name, f.default)
            if chk is not None and value is not dataclasses.MISSING and value is not None:
                try:
                    chk(value)
                except ValueError as e:
                    raise ConfigError(
                        f"--{f.name.replace('_', '-')} (or {cls.ENV_PREFIX}{f.name.upper()}) = {_show(value)}: {e}"
                    ) from None
        try:
            config = cls(**values)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
        config.check()
        return config

    @classmethod
    def main_args(cls: type[C], argv: Sequence[str] | None = None) -> C:
        """`from_args` for a process entry point: a bad setting prints one line and exits with 2."""
        try:
            return cls.from_args(argv)
        except ConfigError as e:
            name = (cls.PROG or cls.__name__).split()[-1]
            print(f"{name}: bad configuration: {e}", file=sys.stderr)
            raise SystemExit(2) from None


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or "none"
    return str(v)


@dataclass(frozen=True, kw_only=True)  # keyword-only: a service's own required fields may follow
class ProcessSettings:
    """What every service process is configured with besides its own settings: shutdown grace,
    logging, and where traces and metrics go."""

    grace_s: float = setting(10.0, "SIGTERM: calls in flight get this long to finish, seconds")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR", parse=parse_log_level)
    otlp_endpoint: str = setting(
        "", "OTLP/gRPC collector for traces, e.g. http://jaeger:4317; empty: OTEL_EXPORTER_OTLP_ENDPOINT, or no export"
    )
    metrics_address: str = setting(
        "", "HOST:PORT of the Prometheus /metrics endpoint; empty: none", check=lambda v: v and check_address(v)
    )

    def check_process(self) -> None:
        if not self.grace_s >= 0:
            raise ConfigError(f"--grace-s must be >= 0, got {self.grace_s}")
