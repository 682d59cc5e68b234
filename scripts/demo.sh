#!/usr/bin/env bash
# The main job: set up, build the real model family (SmolLM2-135M base + four
# fine-tuned variants and their BitDeltas; reused when already built), write
# the quality and memory reports, then serve the family and send it requests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/bitdelta family build
.venv/bin/bitdelta quality
exec .venv/bin/python scripts/demo.py "$@"
