"""The launcher's flags: Megatron-LM's ``pretrain_gpt`` names, one function per group.

:func:`build_parser` is all :mod:`megatron.skrull.arguments` needs; it turns the parsed
namespace into the frozen run configuration and checks it.
"""
from __future__ import annotations

import argparse

from skrull_ext.attention.choice import ENV_VAR as KERNEL_ENV_VAR, KERNEL_CHOICES
from skrull_ext.scheduler.config import POLICIES
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS, budget_ms_arg

# Every policy of the scheduler (flexsp needs SciPy: pip install 'skrull-megatron[bench]').
SCHEDULERS = POLICIES


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser; flag names follow Megatron-LM's ``arguments.py``."""
    ap = argparse.ArgumentParser(prog="pretrain_gpt", description="Skrull-Megatron SFT training",
                                 allow_abbrev=False)
    _model_flags(ap)
    _parallel_flags(ap)
    _optimizer_flags(ap)
    _data_flags(ap)
    _checkpoint_flags(ap)
    _skrull_flags(ap)
    _runtime_flags(ap)
    return ap


def _model_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--vocab-size", type=int, help="override the tokenizer's vocabulary size")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true", help="norm of each query/key head "
                   "before RoPE (Qwen3)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="must be 0: DACP attention has no dropout")
    g.add_argument("--recompute-granularity", choices=("full", "selective"))
    g.add_argument("--recompute-method", choices=("uniform", "block"))
    g.add_argument("--recompute-num-layers", type=int)


def _parallel_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="1F1B pipeline stages (docs/training.md, pipeline parallelism)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="interleaved pipeline schedule: not supported (exits with an error)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (TP > 1; disabled at TP 1)")


def _optimizer_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("batching and optimisation")
    g.add_argument("--global-batch-size", type=int, required=True, help="sequences per iteration")
    g.add_argument("--micro-batch-size", type=int, default=1,
                   help="accepted for Megatron scripts; the scheduler packs micro-batches "
                        "to --skrull-bucket-size tokens instead")
    g.add_argument("--exit-interval", type=int, help="stop after an iteration divisible by it")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-decay-style", default="linear", choices=("constant", "linear", "cosine"))
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state (and fp32 main params) over DP x CP")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--loss-scale", type=float, help="fp16 static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)


def _data_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[])
    g.add_argument("--tokenizer-type")
    g.add_argument("--tokenizer-model")
    g.add_argument("--mock-data", action="store_true", help="synthetic learnable task (default "
                   "when --data-path is not given)")
    g.add_argument("--mock-num-samples", type=int, default=4096)
    g.add_argument("--split", help="train,validation,test weights over --data-path (or "
                   "--mock-data), e.g. 969,30,1; default: all samples train")
    g.add_argument("--valid-data-path", nargs="+", help="a separate validation dataset "
                   "(replaces the --split validation part)")
    g.add_argument("--eval-interval", type=int, help="validate every N iterations (and after "
                   "the last one)")
    g.add_argument("--eval-iters", type=int, help="validation global batches per evaluation "
                   "(default 100 when there is a validation set; 0: never validate)")


def _checkpoint_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("checkpointing and logging")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--pretrained-hf", metavar="DIR", help="initialise from a Hugging Face model "
                   "directory (config.json + safetensors); model flags come from its config")
    g.add_argument("--ckpt-format", default="torch_dist",
                   help="checkpoint format (torch_dist only: Megatron's distributed format)")
    g.add_argument("--finetune", action="store_true",
                   help="--load only the model weights; start at iteration 0 with fresh "
                        "optimizer, LR schedule, data position and RNG")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load the optimizer and LR scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG state")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save a checkpoint at the next iteration boundary and "
                        "exit 0")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir")


def _skrull_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("skrull")
    g.add_argument("--skrull-bucket-size", type=int, required=True, help="tokens per CP rank")
    g.add_argument("--skrull-scheduler", default="skrull", choices=SCHEDULERS)
    g.add_argument("--skrull-objective", default="ring", choices=("paper", "ring"),
                   help="micro-batch time the scheduler minimises: paper (docs/design.md section 3) "
                        "or ring (ours: step by step as the DACP ring runs)")
    g.add_argument("--skrull-plan-budget-ms", type=budget_ms_arg, default=DEFAULT_BUDGET_MS,
                   help="local-search refinement budget per global batch, converted to a "
                        "fixed work count so every rank gets the same plan (0: off; "
                        "docs/scheduler.md)")
    g.add_argument("--skrull-hardware", choices=("cpu", "h100"),
                   help="cost-model preset (default: from the device)")
    g.add_argument("--skrull-cost-model-config",
                   help="JSON cost-model coefficients (seed of --skrull-online-cost-model)")
    g.add_argument("--skrull-plan-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next global batch on a worker thread while this one "
                        "trains (default on)")
    g.add_argument("--skrull-online-cost-model", action=argparse.BooleanOptionalAction,
                   default=False, help="refit the cost model to measured iteration times "
                   "during training (same fit on every rank)")
    g.add_argument("--skrull-attention-kernel", choices=KERNEL_CHOICES,
                   help=f"attention kernel (default ${KERNEL_ENV_VAR}, else auto: torch on CPU; "
                        "te, else flash on CUDA; reference only when asked for)")


def _runtime_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("runtime")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--fp64", action="store_true", help="float64 on CPU (equivalence tests)")
    g.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params/grads")
    g.add_argument("--fp16", action="store_true", help="fp16 params with loss scaling")
