#!/usr/bin/env bash
# The whole GPU check in one command on one H100/H200 (or more GPUs), from an offline kit
# (scripts/prepare_gpu_kit.sh): installs the kit's megatron-core wheel to a temporary site
# directory, builds the C++ scheduler core when g++ and pybind11 are there (else the Python
# scheduler runs), then `tools/check_gpu.py --all` within the time left of BUDGET seconds.
#
#   bash scripts/gpu_check.sh [KIT=.gpu_kit] [OUT=$OUT or ./gpu_check_out]
#   SECTIONS=cp_training,train bash scripts/gpu_check.sh ...   # a rerun of some sections
#
# Writes OUT/gpu_check.json (the report, rewritten after each section) and OUT/gpu_check.log;
# prints a summary table last.  Exit status: check_gpu.py's (0 when every section passed).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KIT=${1:-$ROOT/.gpu_kit}
OUT=${2:-${OUT:-$ROOT/gpu_check_out}}
BUDGET=${BUDGET:-420}
PY=${PYTHON:-python3}
SITE=${SKRULL_GPU_SITE:-/tmp/skrull_gpu_site}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
start=$(date +%s)
say() { echo "$*" | tee -a "$LOG"; }
run() { "$@" 2>&1 | tail -20 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# The commit the reports name: $KIT/commit (written by prepare_gpu_kit.sh), since a copied
# checkout's .git may be stale.
if [ -z "${SKRULL_COMMIT:-}" ] && [ -f "$KIT/commit" ]; then export SKRULL_COMMIT=$(cat "$KIT/commit"); fi

say "== gpu_check: $(date -Is) on $(hostname); $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)"
if ! $PY -c "import megatron.core" 2>/dev/null; then
  whl=$(ls "$KIT"/whl/megatron_core-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    say "== megatron-core from $whl into $SITE"
    run $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$whl"
  else
    say "== no megatron-core here and no wheel in $KIT/whl: training sections will fail"
  fi
fi
export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}

# The C++ core compiles in the background (into build/, then one rename into skrull_ext/),
# while the first sections, which do not schedule, run; a process that starts before it is
# in place plans with the Python reference scheduler (same plans, slower).
suffix=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if [ ! -f "skrull_ext/_C$suffix" ]; then
  if command -v g++ >/dev/null && $PY -c "import pybind11" 2>/dev/null; then
    stage=$ROOT/build/gpu_ext
    rm -rf "$stage" && mkdir -p "$stage/skrull_ext" && ln -s "$ROOT/csrc" "$stage/csrc"
    if [ -f "$KIT/build_ext.sh" ]; then
      say "== C++ scheduler core: $KIT/build_ext.sh in the background"
      build=(bash "$KIT/build_ext.sh" "$stage")
    else
      say "== C++ scheduler core: setup.py build_ext in the background"
      build=($PY setup.py -q build_ext --build-lib "$stage" --build-temp "$stage/tmp")
    fi
    export PY stage suffix start LOG OUT
    setsid bash -c 'if PYTHON=$PY "$@" > "$OUT/build.tmp" 2>&1 \
          && mv "$stage/skrull_ext/_C$suffix" "skrull_ext/_C$suffix"; then
        echo "== C++ scheduler core ready after $(( $(date +%s) - start )) s" >> "$LOG"
      else
        echo "== C++ scheduler core not built: $(tail -3 "$OUT/build.tmp")" >> "$LOG"
      fi; rm -f "$OUT/build.tmp"' build "${build[@]}" &
    builder=$!
  else
    say "== no g++ or pybind11 here: the Python reference scheduler runs (same plans, slower)"
  fi
fi

left=$(( BUDGET - ($(date +%s) - start) ))
say "== tools/check_gpu.py --all with ${left} s left of ${BUDGET} s"
timeout $(( left + 60 )) $PY tools/check_gpu.py --all --out "$OUT" --budget "$(( left - 15 ))" \
  ${SECTIONS:+--sections "$SECTIONS"}
status=$?
if [ -n "${builder:-}" ]; then kill -- -"$builder" 2>/dev/null; wait "$builder" 2>/dev/null; fi
say "== scheduler backend at the end: $($PY -c 'import skrull_ext; print(skrull_ext.BACKEND)' 2>&1 | tail -1)"
say "== gpu_check: exit $status after $(( $(date +%s) - start )) s; report $OUT/gpu_check.json"
exit $status
