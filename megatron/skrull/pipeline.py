"""Pipeline parallelism for Skrull training: the plan's micro-batches through mcore's 1F1B.

``--pipeline-model-parallel-size P`` splits the layers into ``P`` stages (mcore's
``GPTModel`` with ``pre_process``/``post_process``; the embedding on the first stage, the
final norm, output layer and loss on the last; with tied embeddings the last stage keeps a
copy of the word embedding, initialised from the first stage's and kept equal by an
all-reduce of their gradients, as mcore does).  Per iteration every rank of a pipeline
(same DP, CP and TP rank) walks the *same* list of micro-batches, the plan's order for its
DP rank, and hands it to ``forward_backward_pipelining_without_interleaving`` (mcore's
``get_forward_backward_func()``).  The activations between stages are this CP rank's
packed stream ``[T_r, 1, h]``; ``T_r`` changes per micro-batch and per CP rank, so mcore
exchanges shapes first (``variable_seq_lengths``).  Inside each stage the attention is the
usual DACP attention over the CP group of that stage.

One subtlety: without PP a rank holding no tokens in a micro-batch skips it.  Under 1F1B
the position of a micro-batch in the schedule decides when its forward and backward run,
so CP ranks of a stage that skipped different micro-batches would issue their ring
collectives in different orders and deadlock.  Every CP rank therefore runs every
micro-batch that holds tokens on *some* CP rank; a rank with none runs a one-token filler
whose loss mask is 0 (its gradient contribution is exactly zero).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from skrull_ext.attention.layout import build_rank_layout
from skrull_ext.scheduler.plan import Plan

from megatron.skrull.model import SkrullPackedSeqParams

__all__ = ["stage_flags", "pipeline_micro_batches", "filler_inputs", "run_pipeline",
           "pipeline_gradients", "reduce_tied_embedding_grads", "full_to_stage_state_dict",
           "pipeline_grad_norm", "clip_pipeline_grads", "whole_model_name", "pipeline_order"]


def stage_flags() -> dict:
    """``pre_process``/``post_process`` of this rank's stage (from mcore's parallel state)."""
    from megatron.core import parallel_state as ps

    return {"pre_process": ps.is_pipeline_first_stage(),
            "post_process": ps.is_pipeline_last_stage()}


def filler_inputs(cp_rank: int, cp_size: int, cp_group, device: torch.device,
                  attention_backend: str = "auto"):
    """A one-token local micro-batch with loss mask 0 (see the module docstring)."""
    from megatron.skrull.training import MicroBatchInputs

    local = [[0] if r == cp_rank else [] for r in range(cp_size)]
    layout = build_rank_layout([1], [], local, cp_rank, cp_size)
    zeros = torch.zeros((1, 1), dtype=torch.int64, device=device)
    return MicroBatchInputs(
        input_ids=zeros, position_ids=zeros, labels=zeros,
        loss_mask=torch.zeros((1, 1), dtype=torch.float32, device=device),
        packed_seq_params=SkrullPackedSeqParams(layout=layout, cp_group=cp_group,
                                                attention_backend=attention_backend))


def pipeline_order(plan: Plan, cost, order: str = "small-ends") -> Plan:
    """``plan`` with each DP rank's micro-batches in the feed order that shrinks the bubble.

    A micro-batch's time is its slowest CP rank's under the scheduler's cost model (local
    compute + distributed shares); ``small-ends`` (shortest first, second shortest last)
    is usually the fastest order in the 1F1B simulation (``benchmarks/pp_table.py``).
    Deterministic, so every rank reorders alike.
    """
    from skrull_ext.planner.pipeline import order_micro_batches

    full = cost.compute_seconds(plan.lengths)
    share = cost.share_seconds(plan.lengths, plan.cp_size)
    ranks = []
    for mbs in plan.dp_ranks:
        times = [max(float(full[list(r)].sum()) for r in mb.local)
                 + float(share[list(mb.distributed)].sum()) for mb in mbs]
        ranks.append(tuple(mbs[i] for i in order_micro_batches(times, order)))
    return dataclasses.replace(plan, dp_ranks=tuple(ranks))


def pipeline_micro_batches(source, batch_ids: np.ndarray, plan: Plan, groups, device,
                           attention_backend: str = "auto") -> list:
    """This rank's inputs for every micro-batch of its DP rank that holds any tokens.

    The list (and its order) is the same on every stage and every CP rank of the pipeline;
    a CP rank holding no tokens of a micro-batch gets :func:`filler_inputs`.
    """
    from megatron.skrull.training import materialize

    out = []
    for mb in plan.dp_ranks[groups.dp_rank]:
        if mb.is_empty():
            continue
        inputs = materialize(source, batch_ids, plan, mb, groups, device, attention_backend)
        out.append(inputs if inputs is not None else filler_inputs(
            groups.cp_rank, groups.cp_size, groups.cp_group, device, attention_backend))
    return out


def _loss(inputs, normaliser: float, float64_loss: bool, output: torch.Tensor):
    """Last stage: ``(sum of masked token losses / normaliser, tokens, {"loss_sum"})``."""
    if float64_loss:
        losses = F.cross_entropy(output[0].double(), inputs.labels[0], reduction="none")[None]
    else:
        losses = output
    loss_sum = (losses * inputs.loss_mask.to(losses.dtype)).sum()
    tokens = inputs.loss_mask.sum().to(torch.int)
    return loss_sum / normaliser, tokens, {"loss_sum": loss_sum.detach()}


def run_pipeline(model: torch.nn.Module, inputs: Sequence, normaliser: float, *,
                 float64_loss: bool = False, autocast_dtype: Optional[torch.dtype] = None
                 ) -> float:
    """Forward/backward of ``inputs`` through the 1F1B schedule; grads accumulate in ``.grad``.

    Args:
        model: This stage's model.
        inputs: The micro-batches (:func:`pipeline_micro_batches`), same length on every
            stage of the pipeline.
        normaliser: Loss tokens of the whole global batch (each micro-batch's loss is its
            masked token-loss sum over this; mcore's ``calculate_per_token_loss`` keeps
            the schedule from rescaling it).

    Returns:
        Sum of this rank's masked token losses (0 off the last stage).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.skrull.cpu_compat import apply_pipeline_cpu_compat

    device = next(model.parameters()).device
    apply_pipeline_cpu_compat(device)
    config = model.config
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = None  # the training loop reduces gradients

    def forward_step(data_iterator, stage_model):
        inp = next(data_iterator)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            labels = None if float64_loss else inp.labels
            out = stage_model(inp.input_ids, inp.position_ids, None, labels=labels,
                              packed_seq_params=inp.packed_seq_params)
        return out, functools.partial(_loss, inp, normaliser, float64_loss)

    if not inputs:
        return 0.0
    store = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(inputs), model=[model],
        num_microbatches=len(inputs), seq_length=int(inputs[0].input_ids.shape[1]),
        micro_batch_size=1, forward_only=False)
    return float(sum(float(d["loss_sum"]) for d in store))


def pipeline_gradients(trainer, batch_ids: np.ndarray, plan: Plan, normaliser: float) -> float:
    """:meth:`Trainer.compute_gradients` with ``P > 1`` stages (grads zeroed by the caller).

    Runs the 1F1B schedule, sums the tied embedding's gradients between first and last
    stage, all-reduces every stage's gradients (and the loss sum) over its DP x CP group,
    then shares the last stage's loss along the pipeline.

    Returns:
        The global-batch loss (mean over its loss tokens), the same on every rank.
    """
    from megatron.core import parallel_state as ps

    from megatron.skrull.optimizer import allreduce_gradients

    inputs = pipeline_micro_batches(trainer.source, batch_ids, plan, trainer.groups,
                                    trainer.device, trainer.attention_backend)
    loss_sum = run_pipeline(trainer.model, inputs, normaliser,
                            float64_loss=trainer.float64_loss,
                            autocast_dtype=trainer.autocast_dtype)
    reduce_tied_embedding_grads(trainer.model)
    dtype = trainer.params[0].dtype
    total = allreduce_gradients(trainer.params, trainer.groups.grad_group,
                                torch.tensor([loss_sum], dtype=dtype, device=trainer.device))
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return float(total[0]) / normaliser


def reduce_tied_embedding_grads(model: torch.nn.Module) -> None:
    """Sums the word-embedding gradient of the first stage and its copy on the last.

    What mcore's ``finalize_model_grads`` does (``_allreduce_word_embedding_grads``) for
    DDP-wrapped models; our loop keeps plain ``.grad``.
    """
    from megatron.core import parallel_state as ps

    if not model.share_embeddings_and_output_weights or not ps.is_rank_in_embedding_group():
        return
    group = ps.get_embedding_group()
    if dist.get_world_size(group) == 1:
        return
    weight = model.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)


def pipeline_grad_norm(model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                       tp_group) -> torch.Tensor:
    """``[1]`` squared gradient norm of this stage, summed over the pipeline, float64.

    The last stage's copy of a tied word embedding is not counted (it equals the first
    stage's after :func:`reduce_tied_embedding_grads`), as mcore's ``param_is_not_shared``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = torch.zeros(1, dtype=torch.float64, device=next(model.parameters()).device)
    for p in params:
        if p.grad is None or getattr(p, "shared", False) and not model.pre_process:
            continue
        if param_is_not_tensor_parallel_duplicate(p, tp_group):
            sq += p.grad.detach().double().pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sq, group=tp_group)
    dist.all_reduce(sq, group=ps.get_pipeline_model_parallel_group())
    return sq


def full_to_stage_state_dict(full: dict, *, num_layers: int, pp_rank: int, pp_size: int,
                             tied: bool) -> dict:
    """Slices a whole-model ``state_dict`` (one process) into one stage's keys.

    Layers ``[pp_rank L/P, (pp_rank + 1) L/P)`` become ``decoder.layers.0..``; the
    embedding goes to the first stage; ``decoder.final_layernorm`` and ``output_layer`` to
    the last, where a tied model's ``output_layer.weight`` is the word embedding.
    """
    per = num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for key, value in full.items():
        if key.startswith("decoder.layers."):
            idx, rest = key[len("decoder.layers."):].split(".", 1)
            local = int(idx) - pp_rank * per
            if 0 <= local < per:
                out[f"decoder.layers.{local}.{rest}"] = value
        elif key.startswith("embedding."):
            if first:
                out[key] = value
        elif key.startswith(("decoder.final_layernorm", "output_layer")):
            if last:
                out[key] = value
        else:
            out[key] = value
    if tied and last and pp_size > 1:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def clip_pipeline_grads(model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                        max_norm: float, tp_group) -> float:
    """Clips to a global norm over all stages (0 disables); returns the norm before."""
    norm = pipeline_grad_norm(model, params, tp_group).sqrt()
    if max_norm > 0:  # coefficient max_norm / (norm + 1e-6), capped at 1, as torch clips
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None],
                                             max_norm, norm.to(params[0].dtype))
    return float(norm)


def whole_model_name(model: torch.nn.Module):
    """``stage parameter name -> whole-model name`` for this rank's stage (inverse of
    :func:`full_to_stage_state_dict`): layer ``i`` of stage ``s`` is layer ``s L/P + i``;
    the last stage's tied output weight is the word embedding."""
    from megatron.core import parallel_state as ps

    offset = ps.get_pipeline_model_parallel_rank() * len(model.decoder.layers)
    tied = model.share_embeddings_and_output_weights and not model.pre_process

    def rename(name: str) -> str:
        if name.startswith("decoder.layers."):
            idx, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(idx) + offset}.{rest}"
        if tied and name == "output_layer.weight":
            return "embedding.word_embeddings.weight"
        return name

    return rename
