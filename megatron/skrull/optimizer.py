"""AdamW, Megatron's LR schedule, gradient reduction over DP x CP and TP-aware clipping.

We do not use mcore's ``DistributedDataParallel``/``DistributedOptimizer`` (CUDA buffers,
fused kernels); gradients are reduced with one coalesced all-reduce per iteration, which
runs on gloo and NCCL alike.  Semantics follow mcore for TP > 1 without sequence
parallelism: TP-sharded parameters keep their shard's gradient, replicated ones (norms,
biases of row-parallel layers) already agree across the TP group.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron.skrull.arguments import OptimArgs

__all__ = ["LRSchedule", "build_optimizer", "allreduce_gradients", "clip_grad_norm",
           "grad_norm", "sync_parameters"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Linear warmup then constant/linear/cosine decay to ``min_lr`` (Megatron's shapes).

    ``lr_at(i)`` is the LR of (1-based) iteration ``i``: ``lr * i / warmup`` during warmup,
    then decay over ``[warmup, decay_iters]`` and ``min_lr`` after it.
    """

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str

    @classmethod
    def from_args(cls, args: OptimArgs) -> "LRSchedule":
        return cls(lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                   decay_iters=args.lr_decay_iters or args.train_iters,
                   style=args.lr_decay_style)

    def lr_at(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.lr
        span = self.decay_iters - self.warmup_iters
        ratio = 1.0 if span <= 0 else min(1.0, (iteration - self.warmup_iters) / span)
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + (self.lr - self.min_lr) * coeff


def build_optimizer(model: torch.nn.Module, args: OptimArgs) -> torch.optim.AdamW:
    """AdamW with Megatron's grouping: no weight decay on biases and 1-D (norm) params."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)


def allreduce_gradients(params: Sequence[torch.nn.Parameter], group: Optional[dist.ProcessGroup],
                        extra: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Sums gradients (and ``extra`` scalars) over ``group`` in one coalesced all-reduce.

    Parameters without a gradient (a rank that had no tokens this iteration) contribute
    zeros and receive the reduced gradient, so every rank issues the same collective.

    Args:
        params: Parameters in the same order on every rank.
        group: DP x CP group; ``None`` or size 1 reduces nothing.
        extra: ``[k]`` tensor summed along (e.g. the loss sum), returned reduced.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if group is None or dist.get_world_size(group) == 1:
        return extra
    grads = [p.grad for p in params]
    tensors = grads + ([extra.to(grads[0].dtype)] if extra is not None else [])
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    out = _unflatten_dense_tensors(flat, tensors)
    for g, reduced in zip(grads, out):
        g.copy_(reduced)
    return out[-1].to(extra.dtype) if extra is not None else None


def grad_norm(params: Iterable[torch.nn.Parameter], tp_group: Optional[dist.ProcessGroup]) -> float:
    """Global L2 norm of the gradients, counting TP-replicated parameters once."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    device = params[0].grad.device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p, tp_group):
            sq += p.grad.detach().double().pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sq, group=tp_group)
    return float(sq.sqrt())


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float,
                   tp_group: Optional[dist.ProcessGroup]) -> float:
    """Scales gradients so their global norm is at most ``max_norm`` (0 disables).

    Returns:
        The norm before clipping.
    """
    norm = grad_norm(params, tp_group)
    if max_norm > 0 and norm > max_norm:
        coeff = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)
    return norm


def sync_parameters(model: torch.nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Broadcasts every parameter from the first rank of ``group`` (DP x CP replicas).

    Seeded initialisation already agrees across replicas; this makes it a guarantee, as
    mcore's DDP does at wrap time.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    src = dist.get_process_group_ranks(group)[0]
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=src, group=group)
