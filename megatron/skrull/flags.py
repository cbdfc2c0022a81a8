"""The launcher's flags: Megatron-LM's ``pretrain_gpt`` names, one function per group.

:func:`build_parser` is all :mod:`megatron.skrull.arguments` needs; it turns the parsed
namespace into the frozen run configuration and checks it.
"""
from __future__ import annotations

import argparse
import signal

from skrull_ext.attention.choice import ENV_VAR as KERNEL_ENV_VAR, KERNEL_CHOICES
from skrull_ext.scheduler.config import POLICIES
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS, budget_ms_arg

from megatron.skrull.rope import POSITION_EMBEDDING_TYPES

# Every policy of the scheduler (flexsp needs SciPy: pip install 'skrull-megatron[bench]').
SCHEDULERS = POLICIES


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser; flag names follow Megatron-LM's ``arguments.py``."""
    ap = argparse.ArgumentParser(prog="pretrain_gpt", description="Skrull-Megatron SFT training",
                                 allow_abbrev=False)
    _model_flags(ap)
    _position_flags(ap)
    _parallel_flags(ap)
    _optimizer_flags(ap)
    _data_flags(ap)
    _checkpoint_flags(ap)
    _skrull_flags(ap)
    _runtime_flags(ap)
    _megatron_run_flags(ap)
    _megatron_logging_flags(ap)
    # Last: Megatron-LM's other flags, accepted or refused (docs/megatron_flags.md).
    from megatron.skrull.megatron_args import add_megatron_flags

    add_megatron_flags(ap)
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


def _position_flags(ap: argparse.ArgumentParser) -> None:
    """RoPE and its scalings (docs/models.md, long context); Megatron's names and defaults,
    except the type's default: rope (every supported model rotates q/k)."""
    g = ap.add_argument_group("position embedding")
    g.add_argument("--position-embedding-type", default="rope", choices=POSITION_EMBEDDING_TYPES,
                   help="rope or yarn (the others are refused with the reason)")
    g.add_argument("--use-rotary-position-embeddings", action="store_const", const="rope",
                   dest="position_embedding_type", help="deprecated: --position-embedding-type "
                   "rope")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="deprecated; with rope there is no learned table to drop")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dims that RoPE rotates")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float,
                   help="linear position interpolation (Hugging Face rope_type linear)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE scaling (rope_type llama3)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="factor of --use-rope-scaling")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN's factor (with --position-embedding-type yarn)")
    g.add_argument("--yarn-original-max-position-embeddings", type=int,
                   help="YaRN: the context the model was pretrained for (default 4096, or the "
                        "--pretrained-hf config's max_position_embeddings)")
    g.add_argument("--yarn-beta-fast", type=float, help="YaRN ramp start (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, help="YaRN ramp end (default 1)")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="round the YaRN ramp's ends to whole dims (default)")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN attention-factor mscale")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN attention-factor mscale_all_dim")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                   help="accepted: RoPE is never fused here (the unfused path is exact)")
    g.add_argument("--no-rope-freq", help="refused: RoPE runs in every layer")


def _parallel_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="1F1B pipeline stages (docs/parallelism.md)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="interleaved pipeline schedule: not supported (exits with an error)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (TP > 1; disabled at TP 1)")
    g.add_argument("--hybrid-context-parallel", action="store_true",
                   help="Megatron's hybrid CP: the DP x CP ranks form one pool and each "
                        "sample is sharded over a power-of-two group of them (policy "
                        "hybrid-cp; add --skrull-scheduler skrull for Skrull on the same "
                        "pool); needs --max-seqlen-per-dp-cp-rank")
    g.add_argument("--dynamic-context-parallel", action="store_true",
                   help="Megatron-LM dev's name for --hybrid-context-parallel (the same pool), "
                        "with its DefaultDynamicCPScheduler as the policy (dynamic-cp)")
    g.add_argument("--sequence-packing-scheduler", choices=("dp_balanced", "default_dynamic_cp"),
                   help="Megatron-LM dev's packing: dp_balanced (policy dp-balanced) or "
                        "default_dynamic_cp (needs --dynamic-context-parallel); "
                        "--skrull-scheduler overrides either")
    g.add_argument("--min-dynamic-context-parallel-size", type=int, default=1,
                   help="Megatron's smallest dynamic CP group: 1 only")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, metavar="N",
                   help="Megatron's name for --skrull-bucket-size: tokens one rank holds per "
                        "micro-batch")


def _optimizer_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("batching and optimisation")
    g.add_argument("--global-batch-size", type=int, help="sequences per iteration (required "
                   "unless --step-batch-size-schedule gives the sizes)")
    g.add_argument("--step-batch-size-schedule", metavar='"THRESHOLD:BS ..."',
                   help="global batch size by consumed tokens (K/M/B/T suffixes; thresholds "
                        "// --seq-length = samples), Megatron-LM's; the LR schedule counts "
                        "samples")
    g.add_argument("--rampup-batch-size", type=int, nargs=3,
                   metavar=("START", "INCR", "SAMPLES"),
                   help="deprecated in Megatron-LM: ramp from START by INCR to "
                        "--global-batch-size over SAMPLES samples (needs --train-samples)")
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
                   help="shard optimizer state (and fp32 main params) over DP x CP (also "
                        "runs at DP x CP = 1, as in Megatron)")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--loss-scale", type=float, help="fp16 static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--train-iters", type=int, help="iterations to train (or --train-samples)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on --load, the LR schedule flags win over the checkpoint's schedule")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on --load, the checkpoint's LR schedule wins over the flags")
    g.add_argument("--seed", type=int, default=1234)


def _data_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[], help="a prefix, or a weighted blend "
                   "W1 P1 W2 P2 ... (or P1 P2 ...: weights by size), docs/data.md")
    g.add_argument("--data-args-path", help="a file holding the --data-path list")
    g.add_argument("--train-data-path", nargs="+", help="training blend (instead of "
                   "--data-path; no --split)")
    g.add_argument("--per-split-data-args-path", help='JSON {"train": ..., "valid": ...} '
                   "blends (instead of --train-data-path/--valid-data-path)")
    g.add_argument("--tokenizer-type")
    g.add_argument("--tokenizer-model")
    g.add_argument("--mock-data", action="store_true", help="synthetic learnable task (default "
                   "when --data-path is not given)")
    g.add_argument("--mock-num-samples", type=int, default=4096)
    g.add_argument("--use-varlen-dataset", action="store_true",
                   help="Megatron-LM dev's variable-length (THD) dataset: always so here; with "
                        "--mock-data the task takes Megatron's mock lengths")
    g.add_argument("--varlen-mock-dataset-config-json", metavar="JSON_OR_FILE",
                   help="Megatron's mock length config for --use-varlen-dataset --mock-data "
                        "(lognormal distribution or a CSV file; megatron/skrull/varlen_mock.py)")
    g.add_argument("--varlen-sbhd-validation", action="store_true",
                   help="refused: Megatron's padded SBHD reference mode is not implemented")
    g.add_argument("--split", help="train,validation,test weights over --data-path (or "
                   "--mock-data), e.g. 969,30,1; default: all samples train")
    g.add_argument("--valid-data-path", nargs="+", help="separate validation datasets, one "
                   "loss each (replaces the --split validation part)")
    g.add_argument("--eval-interval", type=int, help="validate every N iterations (and after "
                   "the last one)")
    g.add_argument("--eval-iters", type=int, help="validation global batches per evaluation "
                   "(default 100 when there is a validation set; 0: never validate)")


def _checkpoint_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("checkpointing and logging")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int)
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
    g.add_argument("--log-throughput", action="store_true",
                   help="log model TFLOP/s per GPU of every interval, from the documents' real "
                        "lengths (Megatron's count; docs/gpu.md)")


def _skrull_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("skrull")
    g.add_argument("--skrull-bucket-size", type=int, help="tokens per CP rank per micro-batch "
                   "(required; Megatron's --max-seqlen-per-dp-cp-rank is the same)")
    g.add_argument("--skrull-scheduler", choices=SCHEDULERS,
                   help="default skrull (hybrid-cp with --hybrid-context-parallel, dynamic-cp "
                        "with --dynamic-context-parallel, dp-balanced with "
                        "--sequence-packing-scheduler dp_balanced)")
    g.add_argument("--skrull-objective", default="ring", choices=("paper", "ring"),
                   help="micro-batch time the scheduler minimises: paper (docs/design.md section 3) "
                        "or ring (ours: step by step as the DACP ring runs)")
    g.add_argument("--skrull-plan-budget-ms", type=budget_ms_arg, default=DEFAULT_BUDGET_MS,
                   help="plan search budget per global batch (local search, then ruin "
                        "and recreate), converted to a fixed work count so every rank gets "
                        "the same plan (0: off; docs/scheduler_algorithm.md)")
    g.add_argument("--skrull-hardware", choices=("cpu", "h100"),
                   help="cost-model preset (default: from the device)")
    g.add_argument("--skrull-cost-model-config",
                   help="JSON cost-model coefficients (seed of --skrull-online-cost-model)")
    g.add_argument("--skrull-plan-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next global batch on a worker thread while this one "
                        "trains (default on)")
    g.add_argument("--skrull-online-cost-model", action=argparse.BooleanOptionalAction,
                   default=None, help="refit the cost model to measured iteration times "
                   "during training (same fit on every rank; default: on with --device "
                   "cuda, off on CPU, where plans then stay deterministic)")
    g.add_argument("--skrull-lookahead", type=int, default=1, metavar="N",
                   help="plan N global batches together, regrouping their samples between "
                        "the N iterations when the scheduler predicts that faster (1: as "
                        "drawn; docs/lookahead.md)")
    g.add_argument("--skrull-attention-kernel", choices=KERNEL_CHOICES,
                   help=f"attention kernel (default ${KERNEL_ENV_VAR}, else auto: torch on CPU; "
                        "te, else flash on CUDA; reference only when asked for)")


def _runtime_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("runtime")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--fp64", action="store_true", help="float64 on CPU (equivalence tests)")
    g.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params/grads")
    g.add_argument("--fp16", action="store_true", help="fp16 params with loss scaling")


def _megatron_run_flags(ap: argparse.ArgumentParser) -> None:
    """Megatron-LM's run-control flags (megatron/skrull/run_args.py, docs/training.md)."""
    g = ap.add_argument_group("Megatron-LM run control")
    g.add_argument("--train-samples", type=int, help="train for N // --global-batch-size "
                   "iterations; the LR schedule counts samples (instead of --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, help="with --train-samples")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    g.add_argument("--lr-warmup-fraction", type=float,
                   help="warmup as a fraction of the LR decay steps")
    g.add_argument("--decoupled-lr", type=float, help="LR of the input embedding and the "
                   "output layer (mcore's decoupled LR)")
    g.add_argument("--decoupled-min-lr", type=float, help="their minimum LR")
    g.add_argument("--optimizer", default="adam", choices=("adam",),
                   help="adam: AdamW (decoupled weight decay), as Megatron-LM's adam")
    g.add_argument("--exit-duration-in-mins", type=int,
                   help="save a checkpoint and exit after this many minutes")
    g.add_argument("--exit-signal", default="SIGTERM",
                   choices=[s.name for s in signal.Signals],
                   help="the signal --exit-signal-handler catches")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of collective operations")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on positions whose input token is the EOD token")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints without the optimizer and LR schedule state")
    g.add_argument("--no-save-rng", action="store_true", help="checkpoints without RNG state")
    g.add_argument("--padded-vocab-size", type=int,
                   help="vocabulary rows of the model (default: padded --vocab-size)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="use --num-query-groups (GQA)")
    g.add_argument("--attention-backend", choices=("flash", "fused", "unfused", "local", "auto"),
                   help="Megatron-LM's attention back-end, mapped onto "
                        "--skrull-attention-kernel (logged)")
    g.add_argument("--transformer-impl", default="local",
                   choices=("local", "transformer_engine"),
                   help="mcore layer spec (transformer_engine needs Transformer Engine)")


def _megatron_logging_flags(ap: argparse.ArgumentParser) -> None:
    """Megatron-LM's TensorBoard and Weights & Biases flags (megatron/skrull/loggers.py)."""
    g = ap.add_argument_group("Megatron-LM logging")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="forward-backward, optimizer and batch-generator times")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", help="log to Weights & Biases (needs wandb)")
    g.add_argument("--wandb-exp-name", help="the run's name in wandb")
    g.add_argument("--wandb-save-dir", help="wandb's local directory (default SAVE/wandb)")
    g.add_argument("--wandb-entity", help="wandb team or user")
