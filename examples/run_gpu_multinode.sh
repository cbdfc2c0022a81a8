#!/usr/bin/env bash
# Long-context SFT of a Qwen2.5-0.5B-shaped GPT with Skrull scheduling on several GPU nodes,
# the paper's setting (docs/design.md section 8): 4 nodes x 8 GPUs = DP 4 x CP 8, global
# batch 256, bucket 26000 tokens per GPU. Run the same command on every node:
#
#   MASTER_ADDR=node0 NNODES=4 NODE_RANK=<0..3> \
#   DATA_PATH=data/chatqa2 TOKENIZER_MODEL=Qwen2.5-0.5B/tokenizer.json \
#   bash examples/run_gpu_multinode.sh
#
# Data: tokenize chat JSONL with the same tokenizer first (docs/data.md), e.g.
#   python tools/preprocess_sft.py --input chatqa2.jsonl --output-prefix data/chatqa2 \
#       --tokenizer-type HFTokenizer --tokenizer-model Qwen2.5-0.5B/tokenizer.json \
#       --seq-length 131072 --overlong truncate
#
# bf16 params with fp32 main params, the distributed optimizer over DP x CP and selective
# recompute (the paper's 7B setting uses ZeRO-2 and selective recompute); the model starts
# from random weights or resumes from CHECKPOINT_PATH (--save and --load point at the same
# directory, so a restarted job continues). DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Cluster (same on every node except NODE_RANK).
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
NNODES="${NNODES:-4}"
NODE_RANK="${NODE_RANK:-0}"
JOB_ID="${JOB_ID:-skrull-sft}"
# c10d: the rendezvous assigns node ranks (NODE_RANK is ignored, nodes may join in any
# order); static: node NODE_RANK holds ranks NODE_RANK x GPUS_PER_NODE and up.
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
PYTHON="${PYTHON:-python}"

# Inputs and outputs.
DATA_PATH="${DATA_PATH:?set DATA_PATH to the preprocessed prefix (tools/preprocess_sft.py --output-prefix)}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer.json the data was tokenized with}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-runs/qwen2.5-0.5b-sft/ckpt}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-runs/qwen2.5-0.5b-sft/tb}"

# Parallelism: CP inside a node (ring traffic on NVLink), DP = world / CP across nodes.
CP="${CP:-8}"
BUCKET="${BUCKET:-26000}"           # tokens per GPU per micro-batch (docs/design.md section 2)
SEQ_LENGTH="${SEQ_LENGTH:-131072}"  # longest sample; must fit BUCKET x CP when distributed
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-256}"
TRAIN_ITERS="${TRAIN_ITERS:-2000}"
SCHEDULER="${SCHEDULER:-skrull}"

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --rdzv-id "$JOB_ID"
    --rdzv-backend "$RDZV_BACKEND"
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
)

# Qwen2.5-0.5B: 24 layers, hidden 896, FFN 4864, 14 heads, 2 KV heads, QKV bias, tied
# embeddings, RoPE base 1e6, RMSNorm eps 1e-6. The vocabulary comes from the tokenizer.
GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 896
    --ffn-hidden-size 4864
    --num-attention-heads 14
    --group-query-attention
    --num-query-groups 2
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --disable-bias-linear
    --add-qkv-bias
    --rotary-base 1000000
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
)

TRAINING_ARGS=(
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS"
    --lr 1e-5
    --min-lr 1e-6
    --lr-warmup-iters 50
    --lr-decay-style cosine
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --recompute-granularity selective
    --seed 1234
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size "$CP"
)

SKRULL_ARGS=(
    --skrull-bucket-size "$BUCKET"
    --skrull-scheduler "$SCHEDULER"
    --skrull-hardware h100
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --split 98,2,0                  # 2% held out for the validation loss
    --tokenizer-type HFTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-interval 200
    --eval-iters 10
    --save-interval 200
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_DIR"
)

# megatron.skrull.launch is torchrun (same flags, same elastic agent) that exits with the
# failing rank's status (2 = bad input) and one error line instead of torchrun's report.
CMD=(
    "$PYTHON" -m megatron.skrull.launch "${DISTRIBUTED_ARGS[@]}"
    -m megatron.skrull.pretrain_gpt
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
    "${SKRULL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
)

if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${CMD[@]}"
