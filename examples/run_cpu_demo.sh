#!/usr/bin/env bash
# CPU demo of Skrull-Megatron: 2 processes (gloo), context parallel size 2, the embedded
# synthetic corpus and the tiny model of examples/configs/tiny_cpu.sh. No network, no GPU.
#
#   bash examples/run_cpu_demo.sh                 # ~2-3 minutes on 2 cores
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
#   RESUME=1      continue from RUN_DIR/ckpt instead of starting over (deletes nothing)
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
# Megatron-Core's notices that Apex / Transformer Engine are absent are expected on CPU.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Transformer Engine and Apex are not installed,ignore:Apex is not installed,ignore:full scope is deprecated}"

start=$SECONDS
DATA_PREFIX="$RUN_DIR/data/synth_n${DEMO_SAMPLES}_seed${DEMO_SEED}_len${SEQ_LENGTH}"
if [ -f "$DATA_PREFIX.json" ]; then
    echo "== data: reusing $DATA_PREFIX (delete $RUN_DIR/data to rebuild)"
else
    echo "== data: writing the embedded synthetic corpus ($DEMO_SAMPLES samples, longest ~$SEQ_LENGTH tokens) to $DATA_PREFIX"
    mkdir -p "$RUN_DIR/data"
    "$PYTHON" tools/preprocess_sft.py --synthetic "$DEMO_SAMPLES" --seed "$DEMO_SEED" \
        --seq-length "$SEQ_LENGTH" --output-prefix "$DATA_PREFIX"
fi

CKPT="$RUN_DIR/ckpt"
LOAD_ARGS=()
if [ "${RESUME:-0}" = 1 ]; then
    LOAD_ARGS=(--load "$CKPT")
elif [ -d "$CKPT" ]; then
    echo "== removing the previous demo checkpoint $CKPT (RESUME=1 continues from it instead)"
    rm -rf "$CKPT"
fi
TB_ARGS=()
if "$PYTHON" -c "import tensorboard" 2>/dev/null; then
    TB_ARGS=(--tensorboard-dir "$RUN_DIR/tb")
fi

echo "== train: $NPROC processes, CP=$CP, DP=$((NPROC / CP)), scheduler $SCHEDULER, $ITERS iterations of $GBS sequences, bucket $BUCKET tokens per CP rank"
# --standalone: a local rendezvous on a free port, so concurrent demos do not collide.
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m megatron.skrull.pretrain_gpt \
    "${TINY_MODEL_ARGS[@]}" "${TINY_OPTIM_ARGS[@]}" \
    --train-iters "$ITERS" --lr-warmup-iters "$WARMUP" --global-batch-size "$GBS" \
    --context-parallel-size "$CP" --skrull-bucket-size "$BUCKET" --skrull-scheduler "$SCHEDULER" \
    --data-path "$DATA_PREFIX" --device cpu --log-interval "$LOG_INTERVAL" \
    --save "$CKPT" ${LOAD_ARGS[@]+"${LOAD_ARGS[@]}"} ${TB_ARGS[@]+"${TB_ARGS[@]}"} \
    ${COST_ARGS[@]+"${COST_ARGS[@]}"} ${EXTRA_ARGS:-} \
    2>&1 | tee "$RUN_DIR/train.log"

echo "== done in $((SECONDS - start)) s"
echo "   data:        $DATA_PREFIX.{bin,idx,json}"
echo "   checkpoint:  $CKPT (iteration $(cat "$CKPT/latest_checkpointed_iteration.txt"); RESUME=1 ITERS=N continues it)"
echo "   log:         $RUN_DIR/train.log"
if [ ${#TB_ARGS[@]} -gt 0 ]; then
    echo "   tensorboard: tensorboard --logdir $RUN_DIR/tb"
fi
