# The embedded default model and data of the CPU demo; sourced by examples/run_cpu_demo.sh.
#
# A 2-layer, 128-wide GPT (about 0.4 M parameters with the 262-token byte-level vocabulary,
# padded to 384) in the Qwen style (GQA, SwiGLU, RMSNorm, no linear biases, RoPE), trained on
# the built-in synthetic SFT corpus (megatron/skrull/corpus.py: short copy/reverse/... tasks
# with a long tail up to SEQ_LENGTH tokens, so Skrull has long and short samples to place).
# Every value can be overridden from the environment.

SEQ_LENGTH="${SEQ_LENGTH:-16384}"   # longest sample (training positions)
DEMO_SAMPLES="${DEMO_SAMPLES:-2000}" # samples in the synthetic corpus
DEMO_SEED="${DEMO_SEED:-1}"          # corpus seed (same seed, same corpus)

TINY_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 128
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --swiglu
    --normalization RMSNorm
    --disable-bias-linear
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
)

# Optimiser for a short run: cosine decay to a tenth of the peak (the demo adds a warmup of
# a tenth of its iterations).
TINY_OPTIM_ARGS=(
    --lr 2e-3
    --min-lr 2e-4
    --lr-decay-style cosine
    --clip-grad 1.0
    --seed 1234
)
