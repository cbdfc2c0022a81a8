#!/usr/bin/env bash
# CPU demo of Skrull-Megatron: 2 processes (gloo), context parallel size 2, the embedded
# synthetic corpus and the tiny model of examples/configs/tiny_cpu.sh. No network, no GPU.
#
#   bash examples/run_cpu_demo.sh                 # ~2 minutes on 2 quiet cores
#   ITERS=20 SCHEDULER=all-cp bash examples/run_cpu_demo.sh
#
# Environment overrides (defaults in brackets):
#   PYTHON        interpreter with the project's dependencies [.venv/bin/python]
#   RUN_DIR       where data, checkpoint, TensorBoard and the log go [runs/demo]
#   ITERS         training iterations [100]          SCHEDULER  --skrull-scheduler [skrull]
#   NPROC         processes [2]                      CP         --context-parallel-size [2]
#   GBS           --global-batch-size [16]           BUCKET     --skrull-bucket-size [1.5 x SEQ_LENGTH / CP]
#   LOG_INTERVAL  [ITERS / 10, at least 1]           WARMUP     --lr-warmup-iters [ITERS / 10]
#   SEQ_LENGTH, DEMO_SAMPLES, DEMO_SEED: the corpus (examples/configs/tiny_cpu.sh)
#   COST_MODEL    --skrull-cost-model-config [examples/configs/tiny_cpu_cost_model.json: the
#                 cpu constants fitted to this model; COST_MODEL= uses the built-in cpu preset]
#   RESUME=1      continue from RUN_DIR/ckpt (ITERS is the total: RESUME=1 ITERS=200 after a
#                 run of 100 trains 100 more, with the LR schedule of the new total:
#                 Megatron's --override-opt_param-scheduler). Without it the run starts over
#                 and the last checkpoint moves to RUN_DIR/ckpt.previous (restored if the
#                 new run fails before saving); nothing is deleted before every setting is
#                 checked.
#   The log RUN_DIR/train.log is appended to, with a "====" header line per run.
#   EXTRA_ARGS    more pretrain_gpt flags, e.g. "--skrull-hardware cpu"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source examples/configs/tiny_cpu.sh

die() { echo "run_cpu_demo.sh: error: $*" >&2; exit 2; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ]; }

if [ -z "${PYTHON:-}" ]; then
    [ -x .venv/bin/python ] || die "no .venv: run 'bash scripts/install.sh' (or examples/quickstart.sh) first, or set PYTHON=/path/to/python"
    PYTHON=.venv/bin/python
fi
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON is not an interpreter; run 'bash scripts/install.sh' or point PYTHON at one"
RUN_DIR="${RUN_DIR:-runs/demo}"
ITERS="${ITERS:-100}"
SCHEDULER="${SCHEDULER:-skrull}"
NPROC="${NPROC:-2}"
CP="${CP:-2}"
GBS="${GBS:-16}"
for v in ITERS NPROC CP GBS SEQ_LENGTH DEMO_SAMPLES; do
    is_int "${!v}" || die "$v=${!v} must be a positive integer"
done
[ $((NPROC % CP)) -eq 0 ] || die "NPROC=$NPROC is not a multiple of CP=$CP (DP = NPROC / CP); change one of them"
BUCKET="${BUCKET:-$(( SEQ_LENGTH / CP * 3 / 2 ))}"
LOG_INTERVAL="${LOG_INTERVAL:-$(( ITERS >= 10 ? ITERS / 10 : 1 ))}"
WARMUP="${WARMUP:-$(( ITERS / 10 ))}"
COST_ARGS=()
COST_MODEL="${COST_MODEL-examples/configs/tiny_cpu_cost_model.json}"
if [ -n "$COST_MODEL" ]; then
    [ -f "$COST_MODEL" ] || die "COST_MODEL=$COST_MODEL: no such file (COST_MODEL= uses the built-in cpu preset)"
    COST_ARGS=(--skrull-cost-model-config "$COST_MODEL")
fi

# The repository first on the path, so a checkout works without 'pip install -e'.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# One thread per process on a small machine (also silences torchrun's banner about it).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

DATA_PREFIX="$RUN_DIR/data/synth_n${DEMO_SAMPLES}_seed${DEMO_SEED}_len${SEQ_LENGTH}"
CKPT="$RUN_DIR/ckpt"
LOAD_ARGS=()
if [ "${RESUME:-0}" = 1 ]; then
    [ -f "$CKPT/latest_checkpointed_iteration.txt" ] \
        || die "RESUME=1 but $CKPT holds no checkpoint; drop RESUME=1 to start over (or set RUN_DIR)"
    LOAD_ARGS=(--load "$CKPT" --override-opt_param-scheduler)  # the schedule of ITERS
fi
TB_ARGS=()
if "$PYTHON" -c "import tensorboard" 2>/dev/null; then
    TB_ARGS=(--tensorboard-dir "$RUN_DIR/tb")
fi
# shellcheck disable=SC2206  # EXTRA_ARGS is a list of flags
TRAIN_ARGS=("${TINY_MODEL_ARGS[@]}" "${TINY_OPTIM_ARGS[@]}"
    --train-iters "$ITERS" --lr-warmup-iters "$WARMUP" --global-batch-size "$GBS"
    --context-parallel-size "$CP" --skrull-bucket-size "$BUCKET" --skrull-scheduler "$SCHEDULER"
    --data-path "$DATA_PREFIX" --device cpu --log-interval "$LOG_INTERVAL"
    --save "$CKPT" ${LOAD_ARGS[@]+"${LOAD_ARGS[@]}"} ${TB_ARGS[@]+"${TB_ARGS[@]}"}
    ${COST_ARGS[@]+"${COST_ARGS[@]}"} ${EXTRA_ARGS:-})

# Every flag is checked (in ~0.3 s, the launcher's own parser) before anything is written
# or moved, so a typo in BUCKET, SCHEDULER or EXTRA_ARGS costs nothing.
"$PYTHON" - "$NPROC" "${TRAIN_ARGS[@]}" <<'PY' || exit $?
import sys
from megatron.skrull import errors
from megatron.skrull.arguments import ConfigError, parse_args
try:
    errors.parse_quietly(lambda a: parse_args(a, world_size=int(sys.argv[1])), sys.argv[2:])
except ConfigError as exc:
    sys.exit(errors.report(exc.problems))
PY

start=$SECONDS
if [ -f "$DATA_PREFIX.json" ]; then
    echo "== data: reusing $DATA_PREFIX (delete $RUN_DIR/data to rebuild)"
else
    echo "== data: writing the embedded synthetic corpus ($DEMO_SAMPLES samples, longest ~$SEQ_LENGTH tokens) to $DATA_PREFIX"
    mkdir -p "$RUN_DIR/data"
    "$PYTHON" tools/preprocess_sft.py --synthetic "$DEMO_SAMPLES" --seed "$DEMO_SEED" \
        --seq-length "$SEQ_LENGTH" --output-prefix "$DATA_PREFIX"
fi

# Starting over never deletes the last run's checkpoint: it moves to ckpt.previous (the one
# before it is replaced) and comes back if this run fails before saving its own.
PREV="$RUN_DIR/ckpt.previous"
if [ "${RESUME:-0}" != 1 ] && [ -d "$CKPT" ]; then
    echo "== keeping the previous demo checkpoint as $PREV (RESUME=1 continues from $CKPT instead)"
    rm -rf "$PREV"
    mv "$CKPT" "$PREV"
fi

LOG="$RUN_DIR/train.log"
{
    echo "==== run of $(date -u '+%Y-%m-%d %H:%M:%S UTC'): ITERS=$ITERS SCHEDULER=$SCHEDULER NPROC=$NPROC CP=$CP GBS=$GBS BUCKET=$BUCKET RESUME=${RESUME:-0}"
} >> "$LOG"
echo "== train: $NPROC processes, CP=$CP, DP=$((NPROC / CP)), scheduler $SCHEDULER, $ITERS iterations of $GBS sequences, bucket $BUCKET tokens per CP rank"
# megatron.skrull.launch is torchrun (same flags) that exits with the failing rank's status
# and one line instead of torchrun's failure report. --standalone: a local rendezvous on a
# free port, so concurrent demos do not collide.
set +e
"$PYTHON" -m megatron.skrull.launch --standalone --nproc-per-node "$NPROC" \
    -m megatron.skrull.pretrain_gpt "${TRAIN_ARGS[@]}" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    if [ ! -f "$CKPT/latest_checkpointed_iteration.txt" ] && [ -d "$PREV" ]; then
        rm -rf "$CKPT"
        mv "$PREV" "$CKPT"
        echo "== training failed before saving; restored the previous checkpoint to $CKPT" >&2
    fi
    exit "$status"
fi

echo "== done in $((SECONDS - start)) s"
echo "   data:        $DATA_PREFIX.{bin,idx,json}"
echo "   checkpoint:  $CKPT (iteration $(cat "$CKPT/latest_checkpointed_iteration.txt"); RESUME=1 ITERS=N continues it)"
echo "   log:         $LOG (appended, one ==== header per run)"
if [ ${#TB_ARGS[@]} -gt 0 ]; then
    echo "   tensorboard: tensorboard --logdir $RUN_DIR/tb"
fi
