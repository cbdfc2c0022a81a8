"""mcore's data-parallel wrapper, optimizer and LR schedule, configured from our flags.

Nothing here is hand-written numerics: gradients live in mcore's
``DistributedDataParallel`` buffers and are reduced over the data-parallel-with-CP group by
``finalize_model_grads`` (called by the pipeline schedule); AdamW, fp32 main parameters,
loss scaling, TP-aware clipping and the distributed optimizer (state sharded over DP x CP)
come from ``get_megatron_optimizer``; the LR schedule is ``OptimizerParamScheduler``.  On
CPU every call is made inside :func:`megatron.skrull.cpu_compat.cuda_to_cpu`.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.skrull.arguments import OptimArgs
from megatron.skrull.batch_size import BatchSizeArgs
from megatron.skrull.cpu_compat import cuda_to_cpu
from megatron.skrull.run_args import lr_schedule_steps

__all__ = ["wrap_ddp", "build_optimizer", "build_scheduler", "optimizer_config"]


def wrap_ddp(model: torch.nn.Module, args: OptimArgs, *, grad_reduce_in_fp32: bool,
             device: torch.device) -> DistributedDataParallel:
    """Wraps ``model`` in mcore's DDP and broadcasts its parameters from DP x CP rank 0.

    Args:
        model: The (TP-sharded) model; its ``config`` is the TransformerConfig.
        args: ``use_distributed_optimizer``, ``overlap_grad_reduce`` and
            ``overlap_param_gather``.
        grad_reduce_in_fp32: Keep and reduce gradients in fp32 (bf16/fp16 models).
        device: Training device (CPU enters the CUDA-to-CPU mode).
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False)
    with cuda_to_cpu(device):
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        # Seeded init already agrees across replicas; mcore's broadcast makes it a guarantee.
        ddp.broadcast_params()
    return ddp


def optimizer_config(args: OptimArgs, *, params_dtype: torch.dtype, bf16: bool,
                     fp16: bool) -> OptimizerConfig:
    """mcore ``OptimizerConfig`` (Adam with decoupled weight decay = AdamW) for ``args``."""
    return OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=bf16, fp16=fp16, params_dtype=params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        # --decoupled-lr: mcore's standard overrides give the embedding and output layer
        # their own max/min LR, which OptimizerParamScheduler follows per group.
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr)


def build_optimizer(ddp_model: DistributedDataParallel, args: OptimArgs, *,
                    params_dtype: torch.dtype, bf16: bool = False, fp16: bool = False,
                    device: torch.device = torch.device("cpu")) -> MegatronOptimizer:
    """``get_megatron_optimizer`` over the DDP-wrapped model.

    Weight decay follows mcore's grouping (none on biases and 1-D parameters).  Without
    TE/apex mcore falls back to ``torch.optim.AdamW``.
    """
    config = optimizer_config(args, params_dtype=params_dtype, bf16=bf16, fp16=fp16)
    with cuda_to_cpu(device):
        return get_megatron_optimizer(config, [ddp_model],
                                      use_gloo_process_groups=device.type == "cpu")


def build_scheduler(optimizer: MegatronOptimizer, args: OptimArgs,
                    num_steps: Optional[int] = None, *,
                    batch_sizes: Optional[BatchSizeArgs] = None) -> OptimizerParamScheduler:
    """Megatron's LR schedule in iterations (one step per global batch).

    Iteration ``i`` (1-based) trains with the LR of step ``i - 1``: warmup starts at 0, as in
    Megatron.  Weight decay is constant.  Warmup and decay may be fractional iterations
    (``--lr-warmup-fraction``, ``--train-samples``): Megatron-LM counts those in samples,
    and ``samples / global batch`` iterations give the same LR at every iteration.  On
    resume Megatron's switches decide whose schedule wins (``--override-opt_param-scheduler``:
    the flags', ``--use-checkpoint-opt_param-scheduler``: the checkpoint's); without either
    they must agree (checked on load).  With a batch-size schedule (``batch_sizes``) the
    steps are samples, as Megatron-LM counts them: the loop steps by each global batch.
    """
    warmup, decay = lr_schedule_steps(args)
    wd_steps = args.train_iters
    if batch_sizes is not None:
        b = batch_sizes
        warmup, decay, wd_steps = b.lr_warmup_samples, b.lr_decay_samples, b.wd_incr_samples
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=wd_steps, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    if num_steps:
        scheduler.step(increment=num_steps)
    return scheduler
