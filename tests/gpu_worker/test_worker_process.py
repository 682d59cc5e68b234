"""`python -m services.gpu_worker` as a process: flags, health, one request, SIGTERM → clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_process_serves_and_stops_on_sigterm(tmp_path):
    from bitdelta.testing.family import VARIED_STD, make_base, tiny_args

    base = make_base(tmp_path / "base", tiny_args(), seed=1, std=VARIED_STD)
    port = free_port()
    env = {**os.environ, "BITDELTA_WORKER_KV_CACHE": "2MiB", "BITDELTA_KERNEL_BACKEND": "cpu"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.gpu_worker",
            "--base",
            str(base),
            "--address",
            f"127.0.0.1:{port}",
            "--grace-s",
            "5",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 120
            while True:
                try:
                    r = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "worker did not become SERVING"
                time.sleep(0.2)
            stub = pb_grpc.GpuWorkerServiceStub(ch)
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(prompt="hi", sampling=gen_pb.SamplingParams(max_new_tokens=4)), timeout=30
                )
            )
            assert 1 <= len(msgs) <= 4 and msgs[-1].tokens[-1].finish_reason != 0
            st = stub.Status(pb.StatusRequest(), timeout=10)
            assert st.device == "cpu" and st.base_fingerprint and st.kv_tokens_total > 0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "draining" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
