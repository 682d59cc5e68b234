#!/usr/bin/env bash
# The test command: set up (idempotent), check formatting and lint, then run the whole
# suite in a random order (pytest-randomly prints its seed at the top; `--randomly-seed=N`
# repeats an order, `-p no:randomly` keeps the files' order).
# Tests start the servers they need themselves (gRPC services on loopback ports, Swift).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check --quiet . || { echo "[test] ruff format: run '.venv/bin/ruff format .'" >&2; exit 1; }
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q "$@"
