#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite. Tests start
# the servers they need themselves (gRPC services on loopback ports, Swift).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
