"""A real OpenStack Swift (S3 API) for tests, and a TCP relay to cut it off.

Loaded as a pytest plugin (`pytest_plugins = ["tests.support.swift"]`). The
session fixture `swift` installs the Debian packages if needed and starts a
throwaway Swift on free loopback ports through `scripts/swift.sh`, and stops
it at the end. If Swift cannot be installed or started, the tests that use it
FAIL with the reason; they never skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from bitdelta.testing.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "swift.sh"


@dataclass(frozen=True)
class Swift:
    endpoint: str
    access_key: str = "test:tester"
    secret_key: str = "testing"
    region: str = "us-east-1"

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name


def _run(args: list[str], env: dict | None = None, timeout: float = 600) -> None:
    r = subprocess.run(
        ["bash", str(SCRIPT), *args], env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        pytest.fail(
            f"scripts/swift.sh {' '.join(args)} failed (exit {r.returncode}); the S3 backend tests need "
            f"a real Swift:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}",
            pytrace=False,
        )


def free_ports() -> dict[str, str]:
    """scripts/swift.sh's four port variables, each a free loopback port."""
    return {
        k: str(free_port())
        for k in ("SWIFT_PROXY_PORT", "SWIFT_OBJECT_PORT", "SWIFT_CONTAINER_PORT", "SWIFT_ACCOUNT_PORT")
    }


def start_swift(d: Path) -> Swift:
    """A Swift in `d` on free loopback ports (scripts/swift.sh start). A port found free here can
    be taken by another process before Swift binds it, and then Swift never answers: one more try
    on fresh ports (a full CI run once failed so at start-up, and passed on its own)."""
    ports = free_ports()
    try:
        _run(["start", str(d)], env=ports, timeout=180)
    except pytest.fail.Exception:
        _run(["stop", str(d)], timeout=60)
        ports = free_ports()
        _run(["start", str(d)], env=ports, timeout=180)  # a second failure fails the test, with its reason
    return Swift(endpoint=f"http://127.0.0.1:{ports['SWIFT_PROXY_PORT']}")


@pytest.fixture(scope="session")
def swift(tmp_path_factory) -> Swift:
    _run(["install"])
    d = tmp_path_factory.mktemp("swift")
    sw = start_swift(d)
    try:
        yield sw
    finally:
        _run(["stop", str(d)], timeout=60)
        shutil.rmtree(d, ignore_errors=True)


class TcpRelay:
    """Forwards 127.0.0.1:<port> to a target; `down()` refuses and cuts connections, `up()` restores.

    A real network fault between a client and a real server, for outage tests.
    """

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()

    def close(self) -> None:
        self.down()
