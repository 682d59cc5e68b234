"""The delta store's one typed configuration (flags + `BITDELTA_DELTA_STORE_*` variables).

Parsed and checked by the shared `bitdelta.rpc.config.ServiceConfig`: a flag
wins over the variable, the variable over the default; a bad value is a
`ConfigError` naming the flag and the variable. S3 credentials come from the
standard AWS variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) or
boto3's other sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

from bitdelta.rpc.config import ConfigError, ProcessSettings, ServiceConfig, check_address, setting
from bitdelta.rpc.security import AuthSettings, TlsSettings
from bitdelta.rpc.wire.delta_store import MAX_CHUNK_BYTES
from bitdelta.units import parse_bytes

__all__ = ["Config", "ConfigError"]


@dataclass(frozen=True)
class Config(ServiceConfig, ProcessSettings, TlsSettings, AuthSettings):
    """BitDelta delta store: streams delta files from local disk or S3 through a host cache."""

    ENV_PREFIX: ClassVar[str] = "BITDELTA_DELTA_STORE_"
    PROG: ClassVar[str] = "python -m services.delta_store"

    address: str = setting("[::]:50052", "HOST:PORT to listen on", check=check_address)
    backend: str = setting("local", "storage backend: local | s3")
    root: Path | None = setting(
        None, "local backend: the directory of delta files", parse=lambda v: Path(v).expanduser().resolve()
    )
    s3_endpoint: str | None = setting(None, "S3 API URL, e.g. http://127.0.0.1:8080 (default: AWS)")
    s3_bucket: str | None = setting(None, "S3 bucket holding the deltas")
    s3_prefix: str = setting("", "key prefix inside the bucket, ending in '/'")
    s3_region: str = setting("us-east-1", "S3 region")
    cache_bytes: int = setting(1024**3, "host cache budget, e.g. 4GiB; 0 disables the cache", parse=parse_bytes)
    pin_top_n: int = setting(2, "keep the N most requested deltas pinned in the cache")
    rate_half_life_s: float = setting(60.0, "half-life of the request-rate weighting, seconds")
    chunk_bytes: int = setting(1024**2, "default Fetch chunk size", parse=parse_bytes)
    read_block_bytes: int = setting(8 * 1024**2, "backend sequential read size", parse=parse_bytes)
    verify_reads: bool = setting(True, "sha256-check every tensor read from the backend")
    backend_timeout_s: float = setting(5.0, "timeout of one backend request, seconds")
    shared_memory_dir: Path | None = setting(
        None,
        "keep the host cache in files under this directory of a memory filesystem (e.g. /dev/shm/bitdelta) "
        "so workers on this host map them instead of streaming the bytes; they must run as the same user",
        parse=lambda v: Path(v).expanduser().resolve(),
    )

    def check(self) -> None:
        self.check_process()
        self.check_tls()
        self.tokens()  # a tokens file that cannot be used fails at start, naming the flag
        if self.backend not in ("local", "s3"):
            raise ConfigError(f"--backend must be 'local' or 's3', not {self.backend!r} ({self.ENV_PREFIX}BACKEND)")
        if self.backend == "local":
            if self.root is None:
                raise ConfigError(
                    f"the local backend needs --root DIR ({self.ENV_PREFIX}ROOT): the directory of delta files"
                )
            if not self.root.is_dir():
                raise ConfigError(
                    f"--root {self.root} is not an existing directory ({self.ENV_PREFIX}ROOT); create it first"
                )
        else:
            if not self.s3_bucket:
                raise ConfigError(f"the s3 backend needs --s3-bucket ({self.ENV_PREFIX}S3_BUCKET)")
            if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.s3_bucket):
                raise ConfigError(f"--s3-bucket {self.s3_bucket!r} is not a valid S3 bucket name")
            if self.s3_endpoint is not None:
                u = urlparse(self.s3_endpoint)
                if u.scheme not in ("http", "https") or not u.netloc:
                    raise ConfigError(
                        f"--s3-endpoint {self.s3_endpoint!r} must be an http(s):// URL ({self.ENV_PREFIX}S3_ENDPOINT)"
                    )
            if self.s3_prefix and not self.s3_prefix.endswith("/"):
                raise ConfigError(f"--s3-prefix {self.s3_prefix!r} must end with '/'")
        for name, lo, hi in [
            ("chunk_bytes", 1024, MAX_CHUNK_BYTES),
            ("read_block_bytes", 64 * 1024, 1024**3),
            ("cache_bytes", 0, 1 << 50),
            ("pin_top_n", 0, 1 << 20),
        ]:
            if not lo <= getattr(self, name) <= hi:
                raise ConfigError(f"{self.flag_of(name)} must be between {lo} and {hi}, got {getattr(self, name)}")
        if (
            self.shared_memory_dir is not None
            and self.shared_memory_dir.exists()
            and not self.shared_memory_dir.is_dir()
        ):
            raise ConfigError(f"--shared-memory-dir {self.shared_memory_dir} exists and is not a directory")
        if not self.rate_half_life_s > 0 or not self.backend_timeout_s > 0:
            raise ConfigError("--rate-half-life-s and --backend-timeout-s must be > 0")
