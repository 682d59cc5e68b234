#!/usr/bin/env bash
# Certificates and tokens for mutual TLS and bearer tokens (README "Security"; issue #12).
#
#   bash scripts/certs.sh [OUT]        # OUT (default certs/): ca.pem/ca.key, <service>.pem/.key for
#                                      # router, gpu-worker, delta-store, gateway and client, tokens.json
#                                      # (an admin and a user token, by sha256), tokens.txt (the tokens),
#                                      # secrets.yaml (the Secrets deploy/k8s mounts)
#   kubectl apply -f deploy/k8s/00-namespace.yaml -f certs/secrets.yaml && kubectl apply -f deploy/k8s/
#
# Certificates name 127.0.0.1, localhost and each service's Kubernetes names (namespace bitdelta).
# Run again to reissue the certificates with the same CA; tokens.json is kept once it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-certs}
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
"$PY" -c "import cryptography" 2>/dev/null || "$PY" -m pip install -q "cryptography>=44"
"$PY" -m bitdelta.rpc.certs --out "$OUT" --names router,gpu-worker,delta-store,gateway,client \
    --tokens --k8s-secrets "$OUT/secrets.yaml"
