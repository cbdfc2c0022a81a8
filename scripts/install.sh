#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs Skrull-Megatron into it, C++ core included.
#
#   bash scripts/install.sh            # ~1-2 min the first time, ~1 s when nothing changed
#   source .venv/bin/activate          # then skrull-plan, pytest, ... are on the PATH
#
# torch is pinned to the CPU build first so no multi-GB CUDA wheel is pulled in; on a GPU
# machine install your CUDA torch/TE/flash-attn first and set SKRULL_VENV to that env.
#
# The install is skipped when its inputs are unchanged: a SHA-256 of this checkout's path,
# pyproject.toml, setup.py, csrc/* and this script is kept in $VENV/.skrull-install-hash
# (the Python sources need no reinstall: the install is editable). SKRULL_FORCE_INSTALL=1
# reinstalls anyway. `--check` only reports (exit 0 when up to date, 1 otherwise).
# While installing, one line per step with the elapsed time.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd -P)"
VENV="${SKRULL_VENV:-.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.skrull-install-hash"

inputs_hash() {
    {
        echo "$ROOT"
        cat pyproject.toml setup.py scripts/install.sh
        find csrc -type f | LC_ALL=C sort | xargs cat
    } | sha256sum | cut -d' ' -f1
}
HASH="$(inputs_hash)"
up_to_date() {
    [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]
}

case "${1:-}" in
    --check) up_to_date; exit $? ;;
    --hash) echo "$HASH"; exit 0 ;;  # what a finished install records (tests)
esac
if [ "${SKRULL_FORCE_INSTALL:-0}" != 1 ] && up_to_date; then
    echo "== install: $VENV is up to date (pyproject.toml, setup.py, csrc/ unchanged); SKRULL_FORCE_INSTALL=1 reinstalls"
    exit 0
fi

start=$SECONDS
step() { echo "== install [$1/4, $((SECONDS - start)) s]: $2"; }
# Two notices say nothing to act on: pip's line about a configured local index that does
# not exist (once per package on some machines), and setuptools' 10-line box warning that
# an editable install can be shadowed by a same-named folder in the working directory.
# Only those are dropped; every other message passes.
quiet_filter() {
    awk '/^WARNING: Location .* is ignored/ { next }
         /BuildBackendWarning: Editable installation/ { skip = 12 }
         skip > 0 { skip--; if ($0 ~ /WheelFile\(wheel_path/) skip = 0; next }
         { print; fflush() }' >&2
}
pip_q() {
    "$VENV/bin/python" -m pip install -q --progress-bar off "$@" 2> >(quiet_filter)
}

rm -f "$STAMP"  # an interrupted install must not look finished
step 1 "virtual environment $VENV"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip_q --upgrade pip
step 2 "torch 2.13.0, CPU build (the largest download)"
pip_q "torch==2.13.0"
step 3 "Megatron-Core and this project, compiling the C++ scheduler core (~30-60 s)"
SKRULL_BUILD_EXTENSION="${SKRULL_BUILD_EXTENSION:-1}" pip_q -e ".[test,tensorboard]"
step 4 "checking the import"
"$VENV/bin/python" -c "import skrull_ext; print('== install: skrull_ext installed, scheduler backend:', skrull_ext.BACKEND)"
echo "$HASH" > "$STAMP"
echo "== install: done in $((SECONDS - start)) s; activate with: source $VENV/bin/activate"
