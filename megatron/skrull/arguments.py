"""Command-line arguments (Megatron flag names) and the frozen run configuration.

``parse_args(argv, world_size)`` turns flags into a :class:`RunConfig`; every problem found
becomes ONE line of a :class:`ConfigError` (the launcher prints them and exits 2).  Nothing
below the launcher reads argparse state: it receives the frozen dataclasses.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Sequence

from skrull_ext.attention.choice import ENV_VAR as KERNEL_ENV_VAR, KERNEL_CHOICES
from skrull_ext.scheduler.lookahead import MAX_LOOKAHEAD
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS
from skrull_ext.sharding import shard_tokens

from megatron.skrull import hybrid_cp, varlen_mock
from megatron.skrull.blend import blend_flag_problems
from megatron.skrull.errors import ConfigError  # public here too
from megatron.skrull.flags import SCHEDULERS, build_parser  # noqa: F401 - public here too
from megatron.skrull.loggers import LoggingArgs  # public here too
from megatron.skrull.rope import RopeArgs, flag_problems as rope_flag_problems, rope_kwargs
from megatron.skrull.run_args import (MegatronRunArgs, from_namespace, run_problems,
                                      schedule_problems)


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs(RopeArgs):
    """GPT architecture (``--num-layers`` ...); ``None`` sizes take Megatron's defaults.

    The RoPE flags are the fields of its base :class:`megatron.skrull.rope.RopeArgs`.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    max_position_embeddings: int = 4096
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = False
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False
    rotary_base: int = 10000
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        p = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % max(1, self.num_attention_heads):
            p.append(f"--hidden-size {self.hidden_size} is not divisible by "
                     f"--num-attention-heads {self.num_attention_heads}; change one of them "
                     "or set --kv-channels")
        if self.num_attention_heads >= 1 and self.num_query_groups is not None and (
                self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups):
            p.append(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                     f"--num-query-groups {self.num_query_groups}; pick a divisor of the heads")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            p.append(f"--normalization {self.normalization!r}: use LayerNorm or RMSNorm")
        if not 0.0 <= self.hidden_dropout < 1.0:
            p.append(f"--hidden-dropout must be in [0, 1), got {self.hidden_dropout}")
        if self.attention_dropout:
            p.append(f"--attention-dropout {self.attention_dropout}: DACP attention has no "
                     "dropout (SFT runs without it); use --attention-dropout 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            p.append(f"--vocab-size must be >= 1, got {self.vocab_size}")
        if self.num_attention_heads >= 1:
            p.extend(self.rope_problems(self.head_dim))
        _raise_if(p)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """Megatron's default: 4h, or 2/3 of it rounded down to 64 for SwiGLU."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    def padded_vocab_size(self, vocab_size: int, tp_size: int) -> int:
        """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecomputeArgs:
    """Activation recompute (not part of the model: a checkpoint resumes with any setting)."""

    recompute_granularity: Optional[str] = None  # None, "full" or "selective"
    recompute_method: Optional[str] = None  # "uniform" or "block" (full only)
    recompute_num_layers: Optional[int] = None


def _recompute_problems(r: RecomputeArgs, num_layers: int) -> list[str]:
    """Megatron's rules for ``--recompute-*`` (mcore's TransformerConfig checks them too)."""
    p, gran, m = [], r.recompute_granularity, r
    if gran not in (None, "full", "selective"):
        p.append(f"--recompute-granularity {gran!r}: use full or selective")
    elif gran == "full":
        if m.recompute_method not in ("uniform", "block"):
            p.append("--recompute-granularity full needs --recompute-method uniform or block "
                     "(and --recompute-num-layers N)")
        elif m.recompute_num_layers is None or not 1 <= m.recompute_num_layers <= num_layers:
            layers = m.recompute_num_layers
            p.append(f"--recompute-num-layers {layers} must be in [1, --num-layers "
                     f"{num_layers}] with --recompute-granularity full")
    elif m.recompute_method is not None or m.recompute_num_layers is not None:
        p.append("--recompute-method/--recompute-num-layers need --recompute-granularity "
                 "full (selective recomputes core attention in every layer)")
    return p


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelArgs:
    """World size, TP, CP and PP; DP = world / (TP * CP * PP)."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # CP is Megatron's DP x CP pool (--hybrid- or --dynamic-context-parallel, hybrid_cp.py)
    hybrid_context_parallel: bool = False

    def __post_init__(self) -> None:
        p = []
        for name in ("world_size", "tensor_model_parallel_size", "context_parallel_size",
                     "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        mp = (self.tensor_model_parallel_size * self.context_parallel_size
              * self.pipeline_model_parallel_size)
        if not p and self.world_size % mp:
            p.append(f"--tensor-model-parallel-size {self.tensor_model_parallel_size} x "
                     f"--context-parallel-size {self.context_parallel_size} x "
                     f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size} = "
                     f"{mp} does not divide the world size {self.world_size}; launch a multiple "
                     f"of {mp} processes or lower TP/CP/PP")
        _raise_if(p)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimArgs:
    """AdamW, LR schedule, clipping, iterations and seed."""

    lr: float
    train_iters: int
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "linear"
    lr_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    loss_scale: Optional[float] = None  # fp16: None = dynamic loss scaling
    initial_loss_scale: float = 2.0 ** 32
    # Megatron-LM's (run_args.py): warmup as a fraction; embedding/output layer's own LR
    lr_warmup_fraction: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    override_opt_param_scheduler: bool = False  # on --load: the flags' schedule wins
    use_checkpoint_opt_param_scheduler: bool = False  # on --load: the checkpoint's wins

    def __post_init__(self) -> None:
        p = []
        if self.lr < 0:  # 0 is a forward-only check (loss of the initial model)
            p.append(f"--lr must be >= 0, got {self.lr}")
        if not 0 <= self.min_lr <= max(self.lr, 0):
            p.append(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.train_iters < 1:
            p.append(f"--train-iters must be >= 1, got {self.train_iters}")
        if not 0 <= self.lr_warmup_iters <= max(self.train_iters, 0):
            p.append(f"--lr-warmup-iters {self.lr_warmup_iters} must be in [0, --train-iters "
                     f"{self.train_iters}]")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            p.append(f"--lr-decay-style {self.lr_decay_style!r}: use constant, linear or cosine")
        if self.lr_decay_iters is not None and self.lr_decay_iters < self.lr_warmup_iters:
            p.append("--lr-decay-iters must be >= --lr-warmup-iters")
        if self.weight_decay < 0:
            p.append(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            p.append("--overlap-param-gather needs --use-distributed-optimizer (parameters are "
                     "gathered only when the optimizer shards them); add it or drop the flag")
        if self.loss_scale is not None and self.loss_scale <= 0:
            p.append(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.clip_grad < 0:
            p.append(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            p.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                     "conflict (the flags' schedule or the checkpoint's): pick one")
        p.extend(schedule_problems(self))
        _raise_if(p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataArgs:
    """Where samples come from: ``--data-path`` (preprocessed) or the synthetic mock task."""

    data_path: tuple[str, ...] = ()
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    mock_data: bool = False
    mock_num_samples: int = 4096
    split: Optional[str] = None  # train,validation,test weights over the data (Megatron's)
    valid_data_path: tuple[str, ...] = ()  # separate validation datasets (one loss each)
    data_args_path: Optional[str] = None  # a file holding the --data-path list
    train_data_path: tuple[str, ...] = ()  # the training blend, per-split style
    per_split_data_args_path: Optional[str] = None  # JSON {"train", "valid", "test"} blends
    use_varlen_dataset: bool = False  # Megatron-LM dev's flag: its mock lengths (varlen_mock)
    varlen_mock_config: Optional[str] = None  # --varlen-mock-dataset-config-json
    varlen_sbhd_validation: bool = False  # refused

    def __post_init__(self) -> None:
        p = []
        if self.data_path and self.mock_data:
            p.append("--data-path and --mock-data are exclusive; drop one of them")
        p += varlen_mock.flag_problems(
            use_varlen_dataset=self.use_varlen_dataset, use_mock=self.use_mock,
            config=self.varlen_mock_config, sbhd_validation=self.varlen_sbhd_validation)
        p += blend_flag_problems(self)
        if self.split is not None:
            from megatron.skrull.samples import parse_split

            try:
                parse_split(self.split)
            except ValueError as exc:
                p.append(str(exc))
        if self.valid_data_path and self.use_mock:
            p.append("--valid-data-path needs --data-path (the training data it was tokenized "
                     "like); with --mock-data use --split to hold out validation samples")
        if self.mock_num_samples < 1:
            p.append(f"--mock-num-samples must be >= 1, got {self.mock_num_samples}")
        _raise_if(p)

    @property
    def use_mock(self) -> bool:
        return self.mock_data or not (self.data_path or self.data_args_path or
                                      self.train_data_path or self.per_split_data_args_path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointArgs:
    """``--save``/``--load`` (``torch_dist`` checkpoints) and fine-tuning (Megatron semantics).

    ``--pretrained-hf DIR`` initialises the model from a Hugging Face checkpoint (iteration 0,
    fresh optimizer); a checkpoint found in ``--load`` wins over it (a resumed fine-tune).
    ``--finetune`` loads only the model weights of ``--load`` and restarts at iteration 0;
    ``--no-load-optim`` / ``--no-load-rng`` skip the optimizer (and LR scheduler) / RNG state.
    A missing ``--load`` directory is an error unless it is also ``--save`` (restart loops)
    or ``--pretrained-hf`` gives the start.
    """

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    pretrained_hf: Optional[str] = None
    ckpt_format: str = "torch_dist"
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    exit_signal_handler: bool = False
    # --no-save-optim / --no-save-rng: loading such a checkpoint needs --no-load-optim/-rng
    no_save_optim: bool = False
    no_save_rng: bool = False

    def __post_init__(self) -> None:
        p = []
        if self.ckpt_format != "torch_dist":
            p.append(f"--ckpt-format {self.ckpt_format!r} is not supported; use torch_dist "
                     "(megatron.core.dist_checkpointing, loads at any TP/CP/DP layout)")
        if self.save_interval is not None and self.save_interval < 1:
            p.append(f"--save-interval must be >= 1, got {self.save_interval}")
        if (self.load is not None and not os.path.isdir(self.load) and self.load != self.save
                and not self.pretrained_hf):
            # A typo must not silently start a fresh run (Megatron's behaviour).
            p.append(f"--load {self.load}: no such directory; fix the path (or drop --load "
                     "to start from scratch)")
        if self.exit_signal_handler and not self.save:
            p.append("--exit-signal-handler saves a checkpoint on SIGTERM: give --save DIR")
        _raise_if(p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationArgs:
    """``--eval-interval`` / ``--eval-iters`` (Megatron's; megatron/skrull/evaluation.py).

    ``eval_iters`` ``None`` means Megatron's default, 100, used only when a validation set
    exists; an explicit value (or ``--eval-interval``) without one is an error at start-up.
    """

    eval_interval: Optional[int] = None
    eval_iters: Optional[int] = None

    def __post_init__(self) -> None:
        p = []
        if self.eval_interval is not None and self.eval_interval < 1:
            p.append(f"--eval-interval must be >= 1 (iterations between validations), got "
                     f"{self.eval_interval}; drop it to validate only at the end")
        if self.eval_iters is not None and self.eval_iters < 0:
            p.append(f"--eval-iters must be >= 0 (0 turns validation off), got "
                     f"{self.eval_iters}")
        _raise_if(p)

    @property
    def iters(self) -> int:
        """Validation global batches per evaluation (Megatron's default 100)."""
        return 100 if self.eval_iters is None else self.eval_iters

    @property
    def requested(self) -> bool:
        """The user asked for validation (so a missing validation set is an error)."""
        return self.eval_interval is not None or bool(self.eval_iters)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SkrullArgs:
    """Scheduler: bucket (tokens per CP rank per micro-batch), policy and cost model."""

    bucket_size: int
    scheduler: str = "skrull"
    hardware: Optional[str] = None  # None: cpu on --device cpu, h100 on cuda
    cost_model_config: Optional[str] = None
    objective: str = "ring"  # how the scheduler composes a micro-batch's time
    attention_kernel: str = "auto"  # --skrull-attention-kernel, else $SKRULL_ATTENTION_KERNEL
    plan_ahead: bool = True  # --[no-]skrull-plan-ahead: plan batch i+1 while i trains
    online_cost_model: Optional[bool] = None  # --skrull-online-cost-model; None: on CUDA
    plan_budget_ms: float = DEFAULT_BUDGET_MS  # --skrull-plan-budget-ms: refinement work
    lookahead: int = 1  # --skrull-lookahead: global batches planned together (1: as drawn)

    def __post_init__(self) -> None:
        p = []
        if not 1 <= self.lookahead <= MAX_LOOKAHEAD:
            p.append(f"--skrull-lookahead {self.lookahead}: use an integer in [1, "
                     f"{MAX_LOOKAHEAD}] (1 trains every global batch as drawn)")
        if self.attention_kernel not in KERNEL_CHOICES:
            p.append(f"attention kernel {self.attention_kernel!r} (--skrull-attention-kernel or "
                     f"${KERNEL_ENV_VAR}): use one of {', '.join(KERNEL_CHOICES)}")
        if self.scheduler not in SCHEDULERS:
            p.append(f"--skrull-scheduler {self.scheduler!r}: use one of {', '.join(SCHEDULERS)}")
        if self.objective not in ("ring", "paper"):
            p.append(f"--skrull-objective {self.objective!r}: use ring or paper")
        if not 0 <= self.plan_budget_ms < 1e6:  # also rejects nan
            p.append(f"--skrull-plan-budget-ms {self.plan_budget_ms}: use a number of ms in "
                     "[0, 1e6) (0 turns refinement off)")
        if self.hardware not in (None, "cpu", "h100"):
            p.append(f"--skrull-hardware {self.hardware!r}: use cpu or h100")
        if self.cost_model_config is not None and not os.path.isfile(self.cost_model_config):
            p.append(f"--skrull-cost-model-config {self.cost_model_config}: no such file")
        _raise_if(p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one training run needs; cross-group checks live in ``__post_init__``."""

    model: ModelArgs
    parallel: ParallelArgs
    optim: OptimArgs
    data: DataArgs
    skrull: SkrullArgs
    checkpoint: CheckpointArgs = CheckpointArgs()
    logging: LoggingArgs = LoggingArgs()
    global_batch_size: int = 8
    seq_length: int = 4096
    device: str = "auto"
    fp64: bool = False
    bf16: bool = False
    fp16: bool = False
    sequence_parallel: bool = False
    recompute: RecomputeArgs = RecomputeArgs()
    micro_batch_size: int = 1
    exit_interval: Optional[int] = None
    validation: ValidationArgs = ValidationArgs()
    run: MegatronRunArgs = MegatronRunArgs()

    @property
    def params_dtype(self) -> "torch.dtype":
        """Model parameter dtype (the optimizer keeps fp32 main params for bf16/fp16)."""
        import torch

        if self.fp64:
            return torch.float64
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def sequence_parallel_active(self) -> bool:
        """``--sequence-parallel`` with TP > 1; at TP = 1 Megatron disables it (with a
        warning, which the launcher logs) and so do we."""
        return self.sequence_parallel and self.parallel.tensor_model_parallel_size > 1

    def __post_init__(self) -> None:
        _raise_if(cross_problems(self))


def cross_problems(cfg: RunConfig) -> list[str]:
    """Checks that involve several flag groups; one message per problem."""
    p = []
    m, par, cp = cfg.model, cfg.parallel, cfg.parallel.context_parallel_size
    tp = par.tensor_model_parallel_size
    if cfg.global_batch_size < 1:
        p.append(f"--global-batch-size must be >= 1, got {cfg.global_batch_size}")
    if cfg.seq_length < 1:
        p.append(f"--seq-length must be >= 1, got {cfg.seq_length}")
    if cfg.skrull.bucket_size < 2 * cp:
        p.append(f"--skrull-bucket-size {cfg.skrull.bucket_size} is smaller than 2 x "
                 f"--context-parallel-size = {2 * cp} (one zigzag token pair per CP rank); "
                 f"raise it to at least {2 * cp}")
    elif cfg.seq_length >= 1 and shard_tokens(cfg.seq_length, cp) > cfg.skrull.bucket_size:
        p.append(f"--seq-length {cfg.seq_length} does not fit: sharded over {cp} CP ranks a "
                 f"sample needs {shard_tokens(cfg.seq_length, cp)} tokens per rank > "
                 f"--skrull-bucket-size {cfg.skrull.bucket_size} (about bucket x CP = "
                 f"{cfg.skrull.bucket_size * cp}); lower --seq-length or raise the bucket or CP")
    if m.scaled_context(m.max_position_embeddings) < cfg.seq_length:
        p.append(f"--max-position-embeddings {m.max_position_embeddings} < --seq-length "
                 f"{cfg.seq_length}; raise it to at least {cfg.seq_length}"
                 + (f" (or scale RoPE further: {m.rope_type} covers "
                    f"{m.scaled_context(m.max_position_embeddings)})"
                    if m.rope_type != "default" else ""))
    if m.num_attention_heads % tp or m.query_groups % tp:
        p.append(f"--num-attention-heads {m.num_attention_heads} and --num-query-groups "
                 f"{m.query_groups} must both be divisible by --tensor-model-parallel-size {tp}")
    pp = par.pipeline_model_parallel_size
    if m.num_layers % pp:
        p.append(f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
                 f"{pp}; choose a pipeline size that divides the layer count")
    if cfg.device not in ("auto", "cpu", "cuda"):
        p.append(f"--device {cfg.device!r}: use auto, cpu or cuda")
    if cfg.fp64 and cfg.device == "cuda":
        p.append("--fp64 is a CPU test mode; drop it or use --device cpu")
    if cfg.micro_batch_size < 1:
        p.append(f"--micro-batch-size must be >= 1, got {cfg.micro_batch_size}")
    if cfg.exit_interval is not None and cfg.exit_interval < 1:
        p.append(f"--exit-interval must be >= 1, got {cfg.exit_interval}")
    p.extend(_recompute_problems(cfg.recompute, m.num_layers))
    p.extend(run_problems(cfg))
    if sum((cfg.fp64, cfg.bf16, cfg.fp16)) > 1:
        chosen = [f for f, on in (("--fp64", cfg.fp64), ("--bf16", cfg.bf16),
                                  ("--fp16", cfg.fp16)) if on]
        p.append(f"{' and '.join(chosen)} conflict: pick one precision")
    return p


def _group(cls, problems: list[str], **values):
    try:
        return cls(**values)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


def config_from_namespace(ns: argparse.Namespace, world_size: int) -> RunConfig:
    """Builds the frozen :class:`RunConfig`; raises :class:`ConfigError` with every problem."""
    mx = from_namespace(ns)  # Megatron-LM's run-control, sample-based and accepted flags
    p: list[str] = list(mx.problems)
    hybrid, hybrid_problems = hybrid_cp.resolve(ns, world_size)
    p.extend(hybrid_problems)
    model = _group(ModelArgs, p, num_layers=ns.num_layers, hidden_size=ns.hidden_size,
                   num_attention_heads=ns.num_attention_heads, ffn_hidden_size=ns.ffn_hidden_size,
                   num_query_groups=ns.num_query_groups, kv_channels=ns.kv_channels,
                   max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
                   vocab_size=ns.vocab_size,
                   make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
                   swiglu=ns.swiglu, normalization=ns.normalization, norm_epsilon=ns.norm_epsilon,
                   disable_bias_linear=ns.disable_bias_linear, add_qkv_bias=ns.add_qkv_bias,
                   qk_layernorm=ns.qk_layernorm,
                   untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights,
                   rotary_base=ns.rotary_base, hidden_dropout=ns.hidden_dropout,
                   init_method_std=ns.init_method_std, attention_dropout=ns.attention_dropout,
                   **rope_kwargs(ns))
    p.extend(rope_flag_problems(ns))
    parallel = _group(ParallelArgs, p, world_size=world_size,
                      tensor_model_parallel_size=ns.tensor_model_parallel_size,
                      context_parallel_size=hybrid.context_parallel_size,
                      pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
                      hybrid_context_parallel=hybrid.pooled)
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        # Megatron's interleaved schedule needs the same micro-batch shapes per model chunk
        # round; not wired to Skrull's variable per-rank layouts (docs/parallelism.md).
        p.append("--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule is "
                 "not supported with Skrull; drop the flag (non-interleaved 1F1B is used)")
    optim = _group(OptimArgs, p, lr=ns.lr, min_lr=ns.min_lr, **mx.optim,
                   lr_decay_style=ns.lr_decay_style, weight_decay=ns.weight_decay,
                   adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2, adam_eps=ns.adam_eps,
                   clip_grad=ns.clip_grad, seed=ns.seed,
                   use_distributed_optimizer=ns.use_distributed_optimizer,
                   overlap_grad_reduce=ns.overlap_grad_reduce,
                   overlap_param_gather=ns.overlap_param_gather, loss_scale=ns.loss_scale,
                   initial_loss_scale=ns.initial_loss_scale,
                   override_opt_param_scheduler=ns.override_opt_param_scheduler,
                   use_checkpoint_opt_param_scheduler=ns.use_checkpoint_opt_param_scheduler)
    data = _group(DataArgs, p, data_path=tuple(ns.data_path),
                  tokenizer_type=ns.tokenizer_type, tokenizer_model=ns.tokenizer_model,
                  mock_data=ns.mock_data, mock_num_samples=ns.mock_num_samples,
                  split=ns.split, valid_data_path=tuple(ns.valid_data_path or ()),
                  data_args_path=ns.data_args_path,
                  train_data_path=tuple(ns.train_data_path or ()),
                  per_split_data_args_path=ns.per_split_data_args_path,
                  use_varlen_dataset=ns.use_varlen_dataset,
                  varlen_mock_config=ns.varlen_mock_dataset_config_json,
                  varlen_sbhd_validation=ns.varlen_sbhd_validation)
    validation = _group(ValidationArgs, p, eval_interval=ns.eval_interval,
                        eval_iters=ns.eval_iters)
    skrull = _group(SkrullArgs, p, bucket_size=hybrid.bucket_size,
                    scheduler=hybrid.scheduler, hardware=ns.skrull_hardware,
                    objective=ns.skrull_objective,
                    attention_kernel=mx.attention_kernel,
                    cost_model_config=ns.skrull_cost_model_config,
                    plan_ahead=ns.skrull_plan_ahead,
                    online_cost_model=ns.skrull_online_cost_model,
                    plan_budget_ms=ns.skrull_plan_budget_ms, lookahead=ns.skrull_lookahead)
    ckpt = _group(CheckpointArgs, p, save=ns.save, load=ns.load,
                  save_interval=ns.save_interval, pretrained_hf=ns.pretrained_hf,
                  ckpt_format=ns.ckpt_format, finetune=ns.finetune,
                  no_load_optim=ns.no_load_optim, no_load_rng=ns.no_load_rng,
                  exit_signal_handler=ns.exit_signal_handler, **mx.checkpoint)
    log = _group(LoggingArgs, p, log_interval=ns.log_interval,
                 tensorboard_dir=ns.tensorboard_dir, log_throughput=ns.log_throughput,
                 **mx.logging)
    run = _group(MegatronRunArgs, p, **mx.run)
    _raise_if(p)
    return RunConfig(model=model, parallel=parallel, optim=optim, data=data, skrull=skrull,
                     checkpoint=ckpt, logging=log, global_batch_size=mx.global_batch_size,
                     seq_length=ns.seq_length, device=ns.device, fp64=ns.fp64,
                     bf16=ns.bf16, fp16=ns.fp16, sequence_parallel=ns.sequence_parallel,
                     recompute=RecomputeArgs(recompute_granularity=ns.recompute_granularity,
                                             recompute_method=ns.recompute_method,
                                             recompute_num_layers=ns.recompute_num_layers),
                     micro_batch_size=ns.micro_batch_size, exit_interval=ns.exit_interval,
                     validation=validation, run=run)


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1) -> RunConfig:
    """Parses ``argv`` (argparse exits 2 on unknown/missing flags) into a :class:`RunConfig`.

    Raises:
        ConfigError: one message per invalid flag combination.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--pretrained-hf" or a.startswith("--pretrained-hf=") for a in argv):
        # Model flags come from the Hugging Face config.json (explicit ones must agree).
        from megatron.skrull.hf.config import HFConfigError, parse_with_pretrained

        try:
            return config_from_namespace(parse_with_pretrained(parser, argv), world_size)
        except HFConfigError as exc:
            raise ConfigError(exc.problems) from None
    return config_from_namespace(parser.parse_args(argv), world_size)
