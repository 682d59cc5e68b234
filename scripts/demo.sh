#!/usr/bin/env bash
# The main job: set up, build the real model family (SmolLM2-135M base + four
# fine-tuned variants and their BitDeltas; reused when already built), then
# serve the family and send it requests.
#
# A first run builds the quick family (24 fine-tuning steps per variant instead
# of 64) so that it fits in 30 minutes on 2 cores without bf16; a full family
# already in data/ is used as it is. BITDELTA_FULL=1 builds the full family and
# regenerates the quality and memory reports in reports/ (which were made from
# the full family): roughly 1-1.5 hours more on such a machine (estimated).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${BITDELTA_FULL:-0}" = 1 ]; then
    .venv/bin/bitdelta family build
    # the modes of the committed reports/quality.md and the serving default: without --modes every mode of
    # bitdelta.family.modes (~40 per member, the -kl ones 100 distillation steps) takes many hours
    .venv/bin/bitdelta quality --modes matrix matrix-distilled row row-distilled row-sign-emb row-sign-emb-distilled row-sign-emb-gptq
else
    .venv/bin/bitdelta family build --quick
    echo "[demo] the full family and its reports: BITDELTA_FULL=1 bash scripts/demo.sh"
fi
exec .venv/bin/python scripts/demo.py "$@"
