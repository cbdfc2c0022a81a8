#!/usr/bin/env bash
# The main job: install Skrull-Megatron into ./.venv (CPU torch, no GPU needed), then run the
# CPU fine-tuning demo (examples/run_cpu_demo.sh: 2 processes, CP=2, the embedded synthetic
# corpus and tiny model, Skrull scheduling, a checkpoint at the end).
#
#   bash examples/quickstart.sh
#
# The install is skipped when ./.venv already runs this checkout (SKRULL_SKIP_INSTALL=1
# skips it unconditionally, SKRULL_FORCE_INSTALL=1 always reinstalls). Every override of
# run_cpu_demo.sh (ITERS, SCHEDULER, NPROC, CP, ...) passes through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SKRULL_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac

# Installed = the venv imports the project from THIS checkout plus torch and Megatron-Core.
# Run from / so the checkout on the current directory cannot fake the import.
installed() {
    [ -x "$VENV/bin/python" ] || return 1
    (cd / && "$VENV/bin/python" - "$ROOT" <<'PY'
import os, sys
import torch, megatron.core, skrull_ext, megatron.skrull.pretrain_gpt  # noqa: F401
root = os.path.realpath(sys.argv[1])
sys.exit(0 if os.path.realpath(skrull_ext.__file__).startswith(root + os.sep) else 1)
PY
    ) >/dev/null 2>&1
}

if [ "${SKRULL_SKIP_INSTALL:-0}" = 1 ]; then
    echo "== install: skipped (SKRULL_SKIP_INSTALL=1)"
elif [ "${SKRULL_FORCE_INSTALL:-0}" != 1 ] && installed; then
    echo "== install: $VENV already runs this checkout; skipping (SKRULL_FORCE_INSTALL=1 reinstalls)"
else
    echo "== install: scripts/install.sh into $VENV (a few minutes the first time)"
    SKRULL_VENV="$VENV" bash scripts/install.sh
fi

PYTHON="${PYTHON:-$VENV/bin/python}" exec bash examples/run_cpu_demo.sh
