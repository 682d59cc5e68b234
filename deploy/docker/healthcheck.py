"""Container health check: `python /app/healthcheck.py [HOST:PORT]` exits 0 when the service's
grpc.health.v1 says SERVING (default 127.0.0.1:$PORT). Kubernetes uses its native `grpc:` probe
instead; this is for `docker run` / compose."""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

target = sys.argv[1] if len(sys.argv) > 1 else f"127.0.0.1:{os.environ.get('PORT', '50051')}"
try:
    with grpc.insecure_channel(target) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
except grpc.RpcError as e:
    print(f"{target}: {e.code().name}", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
