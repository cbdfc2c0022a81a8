#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs Skrull-Megatron into it, C++ core included.
# torch is pinned to the CPU build first so no multi-GB CUDA wheel is pulled in; on a GPU
# machine install your CUDA torch/TE/flash-attn first and set SKRULL_VENV to that env.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SKRULL_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
SKRULL_BUILD_EXTENSION="${SKRULL_BUILD_EXTENSION:-1}" \
  "$VENV/bin/python" -m pip install -q -e ".[test,tensorboard]"
"$VENV/bin/python" -c "import skrull_ext; print('skrull_ext installed, scheduler backend:', skrull_ext.BACKEND)"
