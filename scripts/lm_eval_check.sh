#!/usr/bin/env bash
# lm-evaluation-harness's local-completions client against the whole system (scripts/lm_eval_check.py),
# in a second virtualenv that adds lm_eval[api] and reuses .venv for everything else (lm_eval stays
# out of the project's own environment).
#
#   bash scripts/lm_eval_check.sh [VARIANT]   # needs .venv (scripts/setup.sh) and the family (data/)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
[ -f data/base/model.safetensors ] || .venv/bin/bitdelta family build --quick
V=.venv/lm-eval  # inside .venv: ignored, and removed with it
if [ ! -x $V/bin/python ]; then
    .venv/bin/python -m venv $V
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lsite=$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$lsite/zz-main-venv.pth"  # .venv's packages after this venv's own
VERSION=${LM_EVAL_VERSION:-0.4.13}
if ! $V/bin/python -c "import lm_eval, tenacity, sys; from importlib.metadata import version; sys.exit(version('lm_eval') != '$VERSION')" 2>/dev/null; then
    $V/bin/python -m pip install -q "lm_eval[api]==$VERSION"
fi
exec $V/bin/python scripts/lm_eval_check.py "$@"
