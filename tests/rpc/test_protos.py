"""The gRPC APIs (protos/): the generated code imports, and `buf lint` passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protos_import():
    from bitdelta.delta_store.v1 import delta_store_pb2, delta_store_pb2_grpc
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2, gpu_worker_pb2_grpc
    from bitdelta.router.v1 import router_pb2, router_pb2_grpc

    assert router_pb2.DESCRIPTOR.package == "bitdelta.router.v1"
    assert gpu_worker_pb2.DeltaState.Name(0) == "DELTA_STATE_UNSPECIFIED"
    assert delta_store_pb2.AlphaMode.Value("ALPHA_MODE_ROW") == 1
    assert hasattr(router_pb2_grpc, "RouterServiceStub")
    assert hasattr(gpu_worker_pb2_grpc, "GpuWorkerServiceServicer")
    assert hasattr(delta_store_pb2_grpc, "add_DeltaStoreServiceServicer_to_server")


def test_buf_lint_passes():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    p = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
