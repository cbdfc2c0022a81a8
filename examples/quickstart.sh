#!/usr/bin/env bash
# The main job: install Skrull-Megatron into ./.venv (CPU torch, no GPU needed), then run the
# CPU fine-tuning demo (examples/run_cpu_demo.sh: 2 processes, CP=2, the embedded synthetic
# corpus and tiny model, Skrull scheduling, a checkpoint at the end).
#
#   bash examples/quickstart.sh
#
# The install is skipped when nothing it depends on changed since the last one (a hash of
# pyproject.toml, setup.py, csrc/ and the install script, kept in the venv);
# SKRULL_SKIP_INSTALL=1 skips it unconditionally, SKRULL_FORCE_INSTALL=1 always reinstalls.
# Every override of run_cpu_demo.sh (ITERS, SCHEDULER, NPROC, CP, ...) passes through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SKRULL_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac

if [ "${SKRULL_SKIP_INSTALL:-0}" = 1 ]; then
    echo "== install: skipped (SKRULL_SKIP_INSTALL=1)"
else
    # scripts/install.sh returns in ~1 s when its inputs are unchanged since the last install.
    SKRULL_VENV="$VENV" bash scripts/install.sh
fi

PYTHON="${PYTHON:-$VENV/bin/python}" exec bash examples/run_cpu_demo.sh
