#!/usr/bin/env bash
# The test command: set up (idempotent), check formatting and lint, then run the whole
# suite in a random order (pytest-randomly, with the seed printed first: RANDOMLY_SEED=N repeats
# an order, `-p no:randomly` keeps the files' order).
# Tests start the servers they need themselves (gRPC services on loopback ports, Swift).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check --quiet . || { echo "[test] ruff format: run '.venv/bin/ruff format .'" >&2; exit 1; }
.venv/bin/ruff check --quiet .
case " $* " in *" no:randomly "* | *"-p no:randomly"*) exec .venv/bin/python -m pytest -q "$@" ;; esac
seed=${RANDOMLY_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
echo "[test] random order: --randomly-seed=$seed (rerun this order: RANDOMLY_SEED=$seed bash scripts/test.sh)"
exec .venv/bin/python -m pytest -q --randomly-seed="$seed" "$@"
