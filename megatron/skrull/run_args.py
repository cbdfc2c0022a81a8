"""Megatron-LM's run-control flags, turned into the frozen configuration's values.

:func:`from_namespace` is the part of :func:`megatron.skrull.arguments.config_from_namespace`
for the Megatron-LM flags that need more than a copy: sample-based training
(``--train-samples``, ``--lr-decay-samples``, ``--lr-warmup-samples`` -> iterations, as
Megatron-LM derives them), ``--attention-backend`` (-> ``--skrull-attention-kernel``), and
the accepted/refused flags of :mod:`megatron.skrull.megatron_args` (-> notes / problems).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
from typing import Any, Optional

from megatron.skrull import batch_size, megatron_args
from megatron.skrull.batch_size import BatchSizeArgs
from megatron.skrull.errors import ConfigError
from megatron.skrull.loggers import wandb_problems

# Megatron-LM's --attention-backend -> our kernel (on CPU, on CUDA).  Megatron-LM's
# flash/fused/unfused pick Transformer Engine's flash-attention, cuDNN fused and unfused
# PyTorch back-ends; local is mcore's own unfused attention.  CPU has one kernel (ATen's
# flash attention); CUDA has no unfused kernel here, so unfused/local take auto.
ATTENTION_BACKEND_KERNELS = {
    "auto": ("auto", "auto"), "flash": ("torch", "flash"), "fused": ("torch", "te"),
    "unfused": ("torch", "auto"), "local": ("torch", "auto")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronRunArgs:
    """Megatron-LM's run-control flags (docs/megatron_flags.md) and the launcher's notes.

    ``notes`` are the log lines about accepted Megatron-LM flags and flag mappings (printed
    once by rank 0); ``padded_vocab_size`` replaces the padding of the vocabulary.
    """

    exit_duration_in_mins: Optional[int] = None  # save and exit after this many minutes
    exit_signal: str = "SIGTERM"  # what --exit-signal-handler catches
    distributed_timeout_minutes: int = 10  # collectives' timeout (Megatron-LM's default)
    eod_mask_loss: bool = False  # no loss where the input token is EOD
    transformer_impl: str = "local"  # mcore layer spec: local or transformer_engine
    padded_vocab_size: Optional[int] = None
    batch_sizes: Optional[BatchSizeArgs] = None  # --step-batch-size-schedule / --rampup-...
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        p = []
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins < 0:
            p.append(f"--exit-duration-in-mins must be >= 0 (0: no limit), got "
                     f"{self.exit_duration_in_mins}")
        if self.distributed_timeout_minutes < 1:
            p.append(f"--distributed-timeout-minutes must be >= 1, got "
                     f"{self.distributed_timeout_minutes}")
        if self.transformer_impl not in ("local", "transformer_engine"):
            p.append(f"--transformer-impl {self.transformer_impl!r}: use local or "
                     "transformer_engine")
        if self.exit_signal not in signal.Signals.__members__:
            p.append(f"--exit-signal {self.exit_signal!r}: use a signal name such as SIGTERM")
        if self.padded_vocab_size is not None and self.padded_vocab_size < 1:
            p.append(f"--padded-vocab-size must be >= 1, got {self.padded_vocab_size}")
        if p:
            raise ConfigError(p)


def schedule_problems(o: Any) -> list[str]:
    """Checks of ``--lr-warmup-fraction`` and ``--decoupled-lr`` on an ``OptimArgs``."""
    p = []
    if o.lr_warmup_fraction is not None:
        if not 0.0 <= o.lr_warmup_fraction <= 1.0:
            p.append(f"--lr-warmup-fraction must be in [0, 1] (a fraction of the decay "
                     f"steps), got {o.lr_warmup_fraction}")
        if o.lr_warmup_iters:
            p.append("can only specify one of --lr-warmup-fraction and --lr-warmup-iters "
                     "(or --lr-warmup-samples); drop one")
    for name in ("decoupled_lr", "decoupled_min_lr"):
        if getattr(o, name) is not None and getattr(o, name) < 0:
            p.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(o, name)}")
    return p


def run_problems(cfg: Any) -> list[str]:
    """Checks of :class:`MegatronRunArgs` against the rest of a ``RunConfig``."""
    padded, tp = cfg.run.padded_vocab_size, cfg.parallel.tensor_model_parallel_size
    p = []
    if padded is not None and padded % tp:
        p.append(f"--padded-vocab-size {padded} is not divisible by "
                 f"--tensor-model-parallel-size {tp}; pick a multiple of {tp}")
    # A lookahead window regroups N equal-sized drawn batches; with a batch-size schedule
    # the window's sizes differ and its exact resume is untested: refused, not guessed.
    if cfg.run.batch_sizes is not None and cfg.skrull.lookahead > 1:
        p.append(f"--skrull-lookahead {cfg.skrull.lookahead} with a batch-size schedule "
                 "(--step-batch-size-schedule / --rampup-batch-size) is not supported; "
                 "use --skrull-lookahead 1 or a fixed --global-batch-size")
    return p


def lr_schedule_steps(o: Any) -> tuple[float, float]:
    """``(warmup, decay)`` of an ``OptimArgs`` in iterations: decay ``--lr-decay-iters``
    (default ``--train-iters``); warmup ``--lr-warmup-fraction`` x decay when given (as
    Megatron-LM), else ``--lr-warmup-iters``."""
    decay = o.lr_decay_iters or o.train_iters
    warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else o.lr_warmup_iters
    return warmup, decay


@dataclasses.dataclass
class MegatronKwargs:
    """Keyword arguments of the configuration groups, and the problems found."""

    optim: dict
    checkpoint: dict
    logging: dict
    run: dict
    attention_kernel: str
    problems: list
    global_batch_size: int = 1


def iteration_schedule(ns: argparse.Namespace, problems: list,
                       gbs: Optional[int] = None) -> dict:
    """``train_iters`` / ``lr_warmup_iters`` / ``lr_decay_iters`` from iterations or samples.

    Sample-based training is Megatron-LM's: ``train_samples // global batch`` iterations,
    and the LR schedule counted in samples -- the same as counting iterations of
    ``samples / global batch`` (a fraction is kept: the schedule's ratios are unchanged).
    """
    it, samples, gbs = ns.train_iters, ns.train_samples, max(1, gbs or ns.global_batch_size or 1)
    out = {"train_iters": it, "lr_warmup_iters": ns.lr_warmup_iters,
           "lr_decay_iters": ns.lr_decay_iters}
    if it is None and samples is None:
        problems.append("give --train-iters N (or Megatron-LM's --train-samples N: "
                        "N // --global-batch-size iterations)")
    elif it is not None and samples is not None:
        problems.append("expected iteration-based or sample-based training: give "
                        "--train-iters or --train-samples, not both")
    elif it is not None:
        for name in ("lr_decay_samples", "lr_warmup_samples"):
            if getattr(ns, name):
                problems.append(f"--{name.replace('_', '-')} needs sample-based training "
                                f"(--train-samples); with --train-iters use "
                                f"--{name.replace('_samples', '_iters').replace('_', '-')}")
        return out
    else:
        for name in ("lr_decay_iters", "lr_warmup_iters"):
            if getattr(ns, name):
                problems.append(f"--{name.replace('_', '-')} needs iteration-based training "
                                f"(--train-iters); with --train-samples use "
                                f"--{name.replace('_iters', '_samples').replace('_', '-')}")
        if samples < gbs:
            problems.append(f"--train-samples {samples} is less than one global batch "
                            f"(--global-batch-size {gbs}): nothing to train")
        decay = ns.lr_decay_samples if ns.lr_decay_samples is not None else samples
        return {"train_iters": samples // gbs, "lr_decay_iters": decay / gbs,
                "lr_warmup_iters": (ns.lr_warmup_samples or 0) / gbs}
    return {**out, "train_iters": 1}  # placeholder: the problem above stops the run


def attention_kernel(ns: argparse.Namespace, notes: list) -> str:
    """``--skrull-attention-kernel``, else ``--attention-backend`` mapped, else
    ``$SKRULL_ATTENTION_KERNEL``, else ``auto``."""
    from skrull_ext.attention.choice import ENV_VAR

    backend = ns.attention_backend
    if ns.skrull_attention_kernel:
        if backend:
            notes.append(f"--attention-backend {backend} ignored: --skrull-attention-kernel "
                         f"{ns.skrull_attention_kernel} given")
        return ns.skrull_attention_kernel
    if not backend:
        return os.environ.get(ENV_VAR) or "auto"
    device = ns.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel = ATTENTION_BACKEND_KERNELS[backend][device == "cuda"]
    notes.append(f"--attention-backend {backend} -> --skrull-attention-kernel {kernel} on "
                 f"{device} (cpu: {ATTENTION_BACKEND_KERNELS[backend][0]}, cuda: "
                 f"{ATTENTION_BACKEND_KERNELS[backend][1]})")
    return kernel


def _gqa_note(ns: argparse.Namespace) -> Optional[str]:
    groups, heads = ns.num_query_groups, ns.num_attention_heads
    if groups is None or groups == heads or ns.group_query_attention or ns.pretrained_hf:
        return None
    return (f"--num-query-groups {groups} without --group-query-attention: Megatron-LM would "
            f"ignore it (multi-head attention); this stack uses {groups} query groups (add "
            "--group-query-attention so the script means the same in both)")


def from_namespace(ns: argparse.Namespace) -> MegatronKwargs:
    """The Megatron-LM flags' share of the configuration (see the module docstring)."""
    problems, notes = megatron_args.problems_and_notes(ns)
    sizes, gbs, ramp_schedule = batch_size.from_namespace(ns, problems, notes)
    # A batch-size schedule keeps the checks and replaces the values (batch sizes vary).
    schedule = {**iteration_schedule(ns, problems, 1 if sizes else None), **ramp_schedule}
    kernel = attention_kernel(ns, notes)
    if (gqa := _gqa_note(ns)) is not None:
        notes.append(gqa)
    if ns.save_interval is not None and not ns.save:
        # Megatron saves only with --save; its own example scripts pass --save-interval
        # 1000000 alone to mean "never", so this is a note, not an error.
        notes.append(f"--save-interval {ns.save_interval} without --save: no checkpoints "
                     "are written (as in Megatron-LM); add --save DIR to keep them")
    problems += wandb_problems(ns.wandb_project, ns.wandb_exp_name, ns.wandb_save_dir, ns.save)
    return MegatronKwargs(
        optim=dict(schedule, lr_warmup_fraction=ns.lr_warmup_fraction,
                   decoupled_lr=ns.decoupled_lr, decoupled_min_lr=ns.decoupled_min_lr),
        checkpoint=dict(no_save_optim=ns.no_save_optim, no_save_rng=ns.no_save_rng),
        logging=dict(log_timers_to_tensorboard=ns.log_timers_to_tensorboard,
                     log_validation_ppl_to_tensorboard=ns.log_validation_ppl_to_tensorboard,
                     wandb_project=ns.wandb_project, wandb_exp_name=ns.wandb_exp_name,
                     wandb_save_dir=ns.wandb_save_dir, wandb_entity=ns.wandb_entity),
        run=dict(exit_duration_in_mins=ns.exit_duration_in_mins, exit_signal=ns.exit_signal,
                 distributed_timeout_minutes=ns.distributed_timeout_minutes,
                 eod_mask_loss=ns.eod_mask_loss, transformer_impl=ns.transformer_impl,
                 padded_vocab_size=ns.padded_vocab_size, batch_sizes=sizes,
                 notes=tuple(notes)),
        attention_kernel=kernel, problems=problems, global_batch_size=gbs)
