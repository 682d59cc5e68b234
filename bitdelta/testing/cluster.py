"""The whole system as separate processes on loopback: a delta store, workers and a router.

    with Cluster(tmp_path) as c:
        store = c.store(root=family.deltas)
        w1 = c.worker(base=family.base, store=store.address, delta_budget="4MiB")
        router = c.router(workers=[w1.address], store=store.address)
        c.wait_serving(store, w1, router)

Each service runs with the exact command line a user would type (`python -m services.<name>`),
logs to a file under the test's directory (shown when a start fails), and is stopped with
SIGTERM at the end (SIGKILL after a timeout). Nothing is mocked.

TLS and tokens (tests/rpc/test_security.py): pass each service its flags in `extra` (`tls_flags`)
and give the cluster the `credentials` its own health checks present (`Cluster(..., credentials=)`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def tls_flags(certs: Path, name: str, client_auth: bool = True) -> tuple[str, ...]:
    """A service's TLS flags for certificates made by `bitdelta.rpc.certs` in `certs` (`name`.pem/.key)."""
    out = (
        "--tls-ca",
        str(certs / "ca.pem"),
        "--tls-cert",
        str(certs / f"{name}.pem"),
        "--tls-key",
        str(certs / f"{name}.key"),
    )
    return out if client_auth else (*out, "--no-tls-client-auth")


_HANDED_OUT: set[int] = set()
_RUNNING: weakref.WeakSet[Cluster] = weakref.WeakSet()  # the clusters not yet stopped (for failure reports)


def free_port() -> int:
    """A loopback port free now and never returned before in this process: the processes of a
    cluster bind theirs only once started, so two calls must not name the same just-closed port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Proc:
    name: str
    address: str
    popen: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout: float = 30) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            self.reap(timeout)
        return self.popen.returncode

    def reap(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the process to exit after its SIGTERM, then kill it."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class Cluster:
    def __init__(
        self, workdir: Path, env: dict[str, str] | None = None, credentials: grpc.ChannelCredentials | None = None
    ):
        self.workdir = Path(workdir)
        self.credentials = credentials  # for wait_serving's health checks when the services serve TLS
        self.workdir.mkdir(parents=True, exist_ok=True)
        # the compiled C kernels on CPU (the Triton interpreter costs seconds per token at model sizes);
        # one thread per process: several share the test machine's cores
        self.env = {
            **os.environ,
            "BITDELTA_KERNEL_BACKEND": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.procs: list[Proc] = []
        _RUNNING.add(self)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, module: str, args: list[str], port: int | None = None) -> Proc:
        port = port or free_port()
        address = f"127.0.0.1:{port}"
        argv = [sys.executable, "-m", module, "--address", address, *args]
        log = self.workdir / f"{name}.log"
        f = open(log, "ab")
        popen = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT)
        f.close()
        p = Proc(name, address, popen, log, argv)
        self.procs.append(p)
        return p

    def store(self, root: Path, name: str = "store", extra: tuple[str, ...] = ()) -> Proc:
        return self.start(
            name, "services.delta_store", ["--backend", "local", "--root", str(root), "--grace-s", "5", *extra]
        )

    def worker(
        self,
        base: Path,
        store: str,
        name: str = "worker",
        delta_budget: str = "8MiB",
        kv_cache: str = "4MiB",
        extra: tuple[str, ...] = (),
    ) -> Proc:
        return self.start(
            name,
            "services.gpu_worker",
            [
                "--base",
                str(base),
                "--delta-store",
                store,
                "--delta-budget",
                delta_budget,
                "--kv-cache",
                kv_cache,
                "--grace-s",
                "5",
                *extra,
            ],
        )

    def router(self, workers: list[str], store: str, name: str = "router", extra: tuple[str, ...] = ()) -> Proc:
        return self.start(
            name,
            "services.router",
            [
                "--workers",
                ",".join(workers),
                "--delta-store",
                store,
                "--poll-s",
                "0.3",
                "--refresh-s",
                "1",
                "--grace-s",
                "5",
                *extra,
            ],
        )

    def gateway(
        self,
        router: str,
        name: str = "gateway",
        chat_template: Path | None = None,
        extra: tuple[str, ...] = (),
        wait: bool = True,
        timeout: float = 120,
    ) -> Proc:
        """The OpenAI-compatible HTTP gateway (`python -m services.gateway`) in front of `router`; with
        `wait`, returns once its /health answers (it is HTTP: `wait_serving` does not apply)."""
        import urllib.request

        args = ["--router", router, "--grace-s", "5"]
        if chat_template is not None:
            args += ["--chat-template", str(chat_template)]
        p = self.start(name, "services.gateway", [*args, *extra])
        deadline = time.monotonic() + timeout
        while wait:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://{p.address}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.name} did not answer /health in {timeout:.0f} s:\n{p.log_text()[-4000:]}")
            time.sleep(0.1)
        return p

    def restart(self, p: Proc) -> Proc:
        """Start `p` again with the same command line (same address)."""
        p.stop()
        f = open(p.log, "ab")
        p.popen = subprocess.Popen(p.argv, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT)
        f.close()
        return p

    def wait_serving(self, *procs: Proc, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            with (
                grpc.secure_channel(p.address, self.credentials)
                if self.credentials
                else grpc.insecure_channel(p.address)
            ) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                while True:
                    if not p.alive():
                        raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_text()[-4000:]}")
                    try:
                        if (
                            stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                            == health_pb2.HealthCheckResponse.SERVING
                        ):
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{p.name} did not become SERVING in {timeout:.0f} s:\n{p.log_text()[-4000:]}"
                        )
                    time.sleep(0.2)

    def stop_all(self, timeout: float = 30) -> None:
        """SIGTERM to every process still running (the last started first), then wait for them: they shut
        down side by side, not one after another (a cluster of 72 processes took 26 s one by one); one
        still running `timeout` seconds after the signal is killed."""
        _RUNNING.discard(self)
        procs = [p for p in reversed(self.procs) if p.alive()]
        for p in procs:
            p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.reap(max(0.0, deadline - time.monotonic()))


def exited_processes(tail_chars: int = 3000) -> list[str]:
    """Each process of a cluster still in use that is no longer running: its name, exit status and
    the end of its log. A failing test's report shows them (tests/conftest.py), so a service that
    died under a test names itself, where the test alone sees only a refused connection."""
    out = []
    for c in list(_RUNNING):
        for p in c.procs:
            if not p.alive():
                out.append(
                    f"{p.name} (python -m {p.argv[2]} at {p.address}) exited with {p.popen.returncode}; "
                    f"the end of its log {p.log}:\n{p.log_text()[-tail_chars:]}"
                )
    return out
