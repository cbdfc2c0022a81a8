"""Megatron-LM's own example scripts' flags, sizes scaled to a tiny CPU model.

Transcribed from Megatron-LM d98e8a64ddf3 (the commit of megatron/skrull/megatron_lm_arguments.txt):
``examples/llama/train_llama3_8b_h100_fp8.sh`` (its MOCK data branch),
``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/post_training/modelopt/conf/Qwen/Qwen2.5-7B-Instruct.sh`` (MODEL_ARGS; the
training flags come from its finetune.sh, so a minimal set is added); and from Megatron-LM
dev d48bd6be ``examples/dynamic_context_parallel/benchmark_dcp.sh`` (both of its cases).  Only sizes change
(layers, widths, heads, sequence, batch, samples, vocabulary, parallel sizes to 1) and paths;
every flag is kept (the GPT-3 script's --step-batch-size-schedule scaled with them, and its
--log-interval 100 made 1 so each iteration's global batch size is logged).  The torchrun
arguments are dropped (one process).

``python tests/_megatron_scripts.py OUT_DIR`` runs every script through the launcher's
``main`` in this one process and writes ``OUT_DIR/results.json``:
``{name: {"rc", "stdout", "stderr"}}``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

SKRULL = ["--skrull-bucket-size", "256", "--device", "cpu"]  # Skrull's one required flag


def llama3_8b_fp8(tmp: str, *, fp8: bool) -> list[str]:
    """train_llama3_8b_h100_fp8.sh (DTYPE=fp8 adds DTYPE_ARGS, as the script does)."""
    model = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
             "--ffn-hidden-size", "224", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
             "--seq-length", "128", "--max-position-embeddings", "128",
             "--position-embedding-type", "rope", "--rotary-base", "1000000",
             "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134",
             "--attention-backend", "fused", "--apply-layernorm-1p",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4",
                "--train-samples", "8", "--lr-decay-samples", "7", "--lr-warmup-samples", "2",
                "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
                "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad",
                "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
                "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level",
                "1", "--exit-duration-in-mins", "235"]
    dtype = (["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
              "--fp8-amax-compute-algo", "max", "--fp8-param-gather"] if fp8 else [])
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                "--sequence-parallel"]
    ddp = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    # bash passes "--split '99,1,0'" as two words, the quotes kept (Megatron-LM's regex
    # ignores them, and so does parse_split).
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--data-cache-path", f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split",
            "'99,1,0'", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
            "--num-workers", "1"]
    logging = ["--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100",
               "--save-interval", "1000", "--log-throughput", "--profile",
               "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
               "torch_dist", "--distributed-timeout-minutes", "60", "--save",
               f"{tmp}/llama_ckpt", "--load", f"{tmp}/llama_ckpt", "--tensorboard-dir",
               f"{tmp}/llama_tb"]
    return model + training + ddp + dtype + parallel + data + logging + SKRULL


# The script's "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536" (tokens; 2048 per sample)
# scaled to --seq-length 128 and a last size of 4: 256 tokens = 2 samples, 512 = 4, 768 = 6,
# so the global batch grows 1, 1, 2, 3, 4 over the first five iterations.
GPT3_SCHEDULE = "0:1 0.256K:2 0.512K:3 0.768K:4"


def gpt3_175b(tmp: str, data_path: str) -> list[str]:
    """train_gpt3_175b_distributed.sh, its --step-batch-size-schedule included."""
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "128", "--max-position-embeddings", "128",
             "--attention-backend", "auto"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4",
                "--step-batch-size-schedule", GPT3_SCHEDULE,
                "--train-iters", "6", "--weight-decay", "0.1", "--adam-beta1", "0.9",
                "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
                "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
                "--lr-warmup-fraction", ".001", "--lr-decay-iters", "5"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    data = ["--data-path", data_path, "--vocab-file", f"{tmp}/gpt2-vocab.json",
            "--merge-file", f"{tmp}/gpt2-merges.txt", "--split", "949,50,1"]
    logging = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
               "--save", f"{tmp}/gpt3_ckpt", "--load", f"{tmp}/gpt3_ckpt", "--eval-iters",
               "1", "--tensorboard-dir", f"{tmp}/gpt3_tb"]
    return model + training + parallel + data + logging + SKRULL


def qwen25_7b(tmp: str) -> list[str]:
    """Qwen2.5-7B-Instruct.sh MODEL_ARGS, plus the few training flags finetune.sh adds."""
    model = ["--save-interval", "100000", "--micro-batch-size", "1", "--bf16",
             "--no-masked-softmax-fusion", "--disable-bias-linear", "--add-qkv-bias",
             "--position-embedding-type", "rope", "--no-rope-fusion", "--normalization",
             "RMSNorm", "--swiglu", "--num-layers", "2", "--hidden-size", "64",
             "--ffn-hidden-size", "160", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
             "--seq-length", "128", "--max-position-embeddings", "256", "--tokenizer-type",
             "HuggingFaceTokenizer", "--padded-vocab-size", "96",
             "--make-vocab-size-divisible-by", "1", "--use-mcore-models", "--rotary-percent",
             "1.0", "--rotary-base", "1000000", "--no-bias-swiglu-fusion",
             "--untie-embeddings-and-output-weights"]
    finetune = ["--mock-data", "--global-batch-size", "4", "--train-iters", "2", "--lr",
                "1e-5", "--save", f"{tmp}/qwen_ckpt"]
    return model + finetune + SKRULL


def dynamic_cp_benchmark(tmp: str, *, dynamic: bool) -> list[str]:
    """Megatron-LM dev d48bd6be examples/dynamic_context_parallel/benchmark_dcp.sh: its
    common flags, then the baseline (dp_balanced) or the dynamic-CP case's; the mock
    length mix scaled as the sequence (128 tokens, one rank in one process), --transformer-impl local
    (no Transformer Engine on CPU; as written it is one error line naming that fix)."""
    lengths = ('{"mode":"distribution","type":"lognormal","format":"thd","min_seq_len":8,'
               '"max_seq_len":128,"mean_seq_len":32,"lognormal_sigma":1.5}')
    model = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
             "--ffn-hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
             "--max-position-embeddings", "128", "--attention-dropout", "0.0",
             "--hidden-dropout", "0.0", "--transformer-impl", "local",
             "--attention-backend", "flash", "--moe-token-dispatcher-type", "alltoall"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3",
                "--lr-decay-iters", "3", "--lr", "1.5e-4", "--min-lr", "1.0e-5",
                "--lr-decay-style", "cosine", "--lr-warmup-iters", "0", "--weight-decay",
                "1.0e-2", "--clip-grad", "1.0", "--bf16", "--calculate-per-token-loss",
                "--no-gradient-accumulation-fusion"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                "--context-parallel-size", "1"]
    data = ["--use-varlen-dataset", "--mock-data", "--varlen-mock-dataset-config-json",
            lengths, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--null-tokenizer-pad-id", "0", "--split", "99,1,0", "--data-cache-path",
            f"{tmp}/data_cache", "--dataloader-type", "single", "--num-workers", "0"]
    logging = ["--log-interval", "1", "--log-throughput", "--timing-log-level", "0",
               "--eval-interval", "1000000", "--eval-iters", "1", "--save-interval", "1000000",
               "--distributed-backend", "nccl", "--distributed-timeout-minutes", "60",
               "--cuda-graph-impl", "none"]
    case = (["--dynamic-context-parallel", "--sequence-packing-scheduler", "default_dynamic_cp",
             "--min-dynamic-context-parallel-size", "1"] if dynamic else
            ["--sequence-packing-scheduler", "dp_balanced"])
    return (model + training + parallel + data + logging + case +
            ["--max-seqlen-per-dp-cp-rank", "128", "--device", "cpu"])


def _run(argv: list[str]) -> dict:
    from megatron.core import parallel_state

    from megatron.skrull.pretrain_gpt import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    parallel_state.destroy_model_parallel()
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _gpt2_files(tmp: str) -> None:
    """The vocab/merges files the gpt3 script names (accepted: the dataset's tokenizer
    is used); tiny stand-ins, never read."""
    with open(f"{tmp}/gpt2-vocab.json", "w") as f:
        json.dump({"a": 0}, f)
    with open(f"{tmp}/gpt2-merges.txt", "w") as f:
        f.write("#version: 0.2\n")


def main(tmp: str) -> None:
    """Runs every script through the launcher, in this process."""
    from megatron.skrull.preprocess import main as preprocess

    prefix = f"{tmp}/gpt3_text_document"
    assert preprocess(["--synthetic", "160", "--seed", "3", "--seq-length", "128",
                       "--synthetic-max-tokens", "129", "--output-prefix", prefix]) == 0
    _gpt2_files(tmp)
    runs = {"llama_fp8": llama3_8b_fp8(tmp, fp8=True), "llama": llama3_8b_fp8(tmp, fp8=False),
            "gpt3": gpt3_175b(tmp, prefix), "qwen": qwen25_7b(tmp),
            "dcp_baseline": dynamic_cp_benchmark(tmp, dynamic=False),
            "dcp": dynamic_cp_benchmark(tmp, dynamic=True)}
    results = {name: _run(argv) for name, argv in runs.items()}
    with open(os.path.join(tmp, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
