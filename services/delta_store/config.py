"""The delta store's one typed configuration, from CLI flags and environment variables.

Every setting has a flag and a `BITDELTA_DELTA_STORE_*` variable; a flag wins
over the variable, the variable over the default. `Config.from_args` checks
everything at start-up and raises `ConfigError` with a message that names the
flag and the variable. S3 credentials come from the standard AWS variables
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) or boto3's other sources.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlparse

from bitdelta.units import parse_bytes

ENV_PREFIX = "BITDELTA_DELTA_STORE_"
MAX_CHUNK_BYTES = 16 * 1024 * 1024  # largest Fetch message payload; clients raise their receive limit to match
class ConfigError(ValueError):
    """A bad setting; the message names the flag and the environment variable."""


@dataclass(frozen=True)
class Config:
    address: str = "[::]:50052"
    backend: str = "local"  # "local" | "s3"
    root: Path | None = None  # local backend: the directory of delta files
    s3_endpoint: str | None = None  # e.g. http://127.0.0.1:8080; None: AWS
    s3_bucket: str | None = None
    s3_prefix: str = ""
    s3_region: str = "us-east-1"
    cache_bytes: int = 1024**3  # host cache budget; 0 disables the cache
    pin_top_n: int = 2
    rate_half_life_s: float = 60.0
    chunk_bytes: int = 1024**2  # default Fetch chunk
    read_block_bytes: int = 8 * 1024**2  # backend sequential read size
    verify_reads: bool = True  # sha256 of every tensor read from the backend
    backend_timeout_s: float = 5.0
    grace_s: float = 10.0
    log_level: str = "INFO"

    def check(self) -> "Config":
        if self.backend not in ("local", "s3"):
            raise ConfigError(f"--backend must be 'local' or 's3', not {self.backend!r} ({ENV_PREFIX}BACKEND)")
        if self.backend == "local":
            if self.root is None:
                raise ConfigError(f"the local backend needs --root DIR ({ENV_PREFIX}ROOT): the directory of delta files")
            if not self.root.is_dir():
                raise ConfigError(f"--root {self.root} is not an existing directory ({ENV_PREFIX}ROOT); create it first")
        else:
            if not self.s3_bucket:
                raise ConfigError(f"the s3 backend needs --s3-bucket ({ENV_PREFIX}S3_BUCKET)")
            if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.s3_bucket):
                raise ConfigError(f"--s3-bucket {self.s3_bucket!r} is not a valid S3 bucket name")
            if self.s3_endpoint is not None:
                u = urlparse(self.s3_endpoint)
                if u.scheme not in ("http", "https") or not u.netloc:
                    raise ConfigError(f"--s3-endpoint {self.s3_endpoint!r} must be an http(s):// URL ({ENV_PREFIX}S3_ENDPOINT)")
            if self.s3_prefix and not self.s3_prefix.endswith("/"):
                raise ConfigError(f"--s3-prefix {self.s3_prefix!r} must end with '/'")
        if not re.fullmatch(r"(\[[0-9a-fA-F:.]*\]|[\w.-]+):\d{1,5}", self.address):
            raise ConfigError(f"--address {self.address!r} must be HOST:PORT, e.g. [::]:50052 ({ENV_PREFIX}ADDRESS)")
        for name, value, lo, hi in [
            ("chunk-bytes", self.chunk_bytes, 1024, MAX_CHUNK_BYTES),
            ("read-block-bytes", self.read_block_bytes, 64 * 1024, 1024**3),
            ("cache-bytes", self.cache_bytes, 0, 1 << 50),
            ("pin-top-n", self.pin_top_n, 0, 1 << 20),
        ]:
            if not lo <= value <= hi:
                raise ConfigError(f"--{name} must be between {lo} and {hi}, got {value}")
        if not self.rate_half_life_s > 0 or not self.backend_timeout_s > 0 or self.grace_s < 0:
            raise ConfigError("--rate-half-life-s and --backend-timeout-s must be > 0, --grace-s >= 0")
        return self

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> "Config":
        env = os.environ if env is None else env
        p = argparse.ArgumentParser(prog="python -m services.delta_store", description=__doc__.split("\n")[0],
                                    epilog=f"Every flag also reads {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}CACHE_BYTES).")
        p.add_argument("--address", help="HOST:PORT to listen on (default [::]:50052)")
        p.add_argument("--backend", choices=["local", "s3"], help="storage backend (default local)")
        p.add_argument("--root", help="local backend: directory of delta files")
        p.add_argument("--s3-endpoint", help="S3 API URL (default: AWS)")
        p.add_argument("--s3-bucket", help="S3 bucket holding the deltas")
        p.add_argument("--s3-prefix", help="key prefix inside the bucket, ending in '/'")
        p.add_argument("--s3-region", help="S3 region (default us-east-1)")
        p.add_argument("--cache-bytes", help="host cache budget, e.g. 4GiB; 0 disables (default 1GiB)")
        p.add_argument("--pin-top-n", help="keep the N most requested deltas pinned in the cache (default 2)")
        p.add_argument("--rate-half-life-s", help="half-life of the request-rate weighting (default 60)")
        p.add_argument("--chunk-bytes", help="default Fetch chunk size (default 1MiB)")
        p.add_argument("--read-block-bytes", help="backend sequential read size (default 8MiB)")
        p.add_argument("--verify-reads", help="sha256-check every tensor read from the backend: true|false (default true)")
        p.add_argument("--backend-timeout-s", help="timeout of one backend request (default 5)")
        p.add_argument("--grace-s", help="seconds in-flight calls get to finish on SIGTERM (default 10)")
        p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
        args = vars(p.parse_args(argv))

        d = cls()
        raw = {k: (v if v is not None else env.get(ENV_PREFIX + k.upper())) for k, v in args.items()}

        def conv(key, fn, default):
            v = raw[key]
            if v is None or v == "":
                return default
            try:
                return fn(v)
            except ValueError as e:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"{flag} (or {ENV_PREFIX}{key.upper()}) = {v!r}: {e}") from None

        cfg = cls(
            address=conv("address", str, d.address),
            backend=conv("backend", str, d.backend),
            root=conv("root", lambda v: Path(v).expanduser().resolve(), None),
            s3_endpoint=conv("s3_endpoint", str, None),
            s3_bucket=conv("s3_bucket", str, None),
            s3_prefix=conv("s3_prefix", str, ""),
            s3_region=conv("s3_region", str, d.s3_region),
            cache_bytes=conv("cache_bytes", parse_bytes, d.cache_bytes),
            pin_top_n=conv("pin_top_n", int, d.pin_top_n),
            rate_half_life_s=conv("rate_half_life_s", float, d.rate_half_life_s),
            chunk_bytes=conv("chunk_bytes", parse_bytes, d.chunk_bytes),
            read_block_bytes=conv("read_block_bytes", parse_bytes, d.read_block_bytes),
            verify_reads=conv("verify_reads", parse_bool, d.verify_reads),
            backend_timeout_s=conv("backend_timeout_s", float, d.backend_timeout_s),
            grace_s=conv("grace_s", float, d.grace_s),
            log_level=conv("log_level", _log_level, d.log_level),
        )
        return cfg.check()



def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _log_level(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
    return text.upper()
