"""Pipeline parallelism for Skrull training: the plan's micro-batches through mcore's 1F1B.

``--pipeline-model-parallel-size P`` splits the layers into ``P`` stages (mcore's
``GPTModel`` with ``pre_process``/``post_process``; the embedding on the first stage, the
final norm, output layer and loss on the last; with tied embeddings the last stage keeps a
copy of the word embedding, initialised from the first stage's at build time).  The
training loop (:meth:`megatron.skrull.training.Trainer.compute_gradients`) is the same as
without PP: mcore's ``get_forward_backward_func()`` -- now
``forward_backward_pipelining_without_interleaving`` -- with the per-token loss, DDP, and
``finalize_model_grads`` (gradients over DP x CP, the tied embedding's gradient summed
between first and last stage, division by the global batch's loss tokens); mcore's
optimizer clips with the norm over all stages.  This module supplies what is
pipeline-specific: the micro-batch list every rank of a pipeline feeds, the feed order, and
whole-model <-> stage parameter names.

Activations between stages are this CP rank's packed stream ``[T_r, 1, h]``; ``T_r``
changes per micro-batch and per CP rank, so mcore exchanges shapes first
(``variable_seq_lengths``).  Inside each stage the attention is the usual DACP attention
over that stage's CP group.

Without PP a rank holding no tokens in a micro-batch does no model compute for it.  Under
1F1B the position of a micro-batch in the schedule decides when its forward and backward
run, so every CP rank must feed the same list: every micro-batch holding tokens on *some*
CP rank; a rank with none runs a one-token filler whose loss mask is 0 (its gradient
contribution is exactly zero).  Micro-batches empty everywhere are dropped.
"""
from __future__ import annotations

import numpy as np
import torch

from skrull_ext.attention.layout import build_rank_layout
from skrull_ext.scheduler.plan import Plan

from megatron.skrull.micro_batch import MicroBatchInputs, materialize
from megatron.skrull.model import SkrullPackedSeqParams

__all__ = ["pipeline_micro_batches", "filler_inputs", "full_to_stage_state_dict",
           "whole_model_name"]


def filler_inputs(cp_rank: int, cp_size: int, cp_group, device: torch.device,
                  attention_backend: str = "auto"):
    """A one-token local micro-batch with loss mask 0 (see the module docstring)."""
    local = [[0] if r == cp_rank else [] for r in range(cp_size)]
    layout = build_rank_layout([1], [], local, cp_rank, cp_size)
    zeros = torch.zeros((1, 1), dtype=torch.int64, device=device)
    return MicroBatchInputs(
        input_ids=zeros, position_ids=zeros, labels=zeros,
        loss_mask=torch.zeros((1, 1), dtype=torch.float32, device=device),
        packed_seq_params=SkrullPackedSeqParams(layout=layout, cp_group=cp_group,
                                                attention_backend=attention_backend))


def pipeline_micro_batches(source, batch_ids: np.ndarray, plan: Plan, groups, device,
                           attention_backend: str = "auto") -> list:
    """This rank's inputs for every micro-batch of its DP rank that holds any tokens.

    The list (and its order) is the same on every stage and every CP rank of the pipeline;
    a CP rank holding no tokens of a micro-batch gets :func:`filler_inputs`.
    """
    out = []
    for mb in plan.dp_ranks[groups.dp_rank]:
        if mb.is_empty():
            continue
        inputs = materialize(source, batch_ids, plan, mb, groups, device, attention_backend)
        out.append(inputs if inputs is not None else filler_inputs(
            groups.cp_rank, groups.cp_size, groups.cp_group, device, attention_backend))
    if not out:  # the schedule needs one micro-batch; a DP rank without samples runs a filler
        out.append(filler_inputs(groups.cp_rank, groups.cp_size, groups.cp_group, device,
                                 attention_backend))
    return out


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
