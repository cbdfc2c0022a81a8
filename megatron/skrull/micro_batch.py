"""One rank's inputs of one micro-batch: the samples it holds, packed in its layout.

Shared by the training loop (:mod:`megatron.skrull.training`) and the pipeline feed
(:mod:`megatron.skrull.pipeline`), so neither imports the other for it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from skrull_ext.attention.layout import layout_for_micro_batch, pack_samples
from skrull_ext.attention.meta import stage_layout, staged_positions
from skrull_ext.scheduler.plan import MicroBatch, Plan

from megatron.skrull.model import SkrullPackedSeqParams
from megatron.skrull.samples import SampleSource


@dataclasses.dataclass(frozen=True)
class MicroBatchInputs:
    """One rank's packed tensors for one micro-batch (batch dim 1, ``T`` tokens)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 per sample
    labels: torch.Tensor  # [1, T] int64
    loss_mask: torch.Tensor  # [1, T] float, 0 on prompts and padding
    packed_seq_params: SkrullPackedSeqParams


def materialize(source: SampleSource, batch_ids: np.ndarray, plan: Plan, mb: MicroBatch,
                groups, device: torch.device,
                attention_backend: str = "auto") -> Optional[MicroBatchInputs]:
    """Packs the samples this CP rank holds in ``mb``; ``None`` when it holds none.

    Args:
        source: Sample source (dataset indices ``batch_ids[i]``).
        batch_ids: ``[K]`` dataset indices of the global batch (plan indices refer here).
        plan: The iteration's plan (its ``lengths`` drive the layout).
        mb: This DP rank's micro-batch.
        groups: This rank's coordinates (:class:`megatron.skrull.training.ParallelGroups`:
            ``cp_rank``, ``cp_group``).
        device: Where the tensors go.
        attention_backend: ``dacp_attention``'s kernel back-end.
    """
    layout = layout_for_micro_batch(mb, plan.lengths, groups.cp_rank)
    if layout.num_tokens == 0:
        return None
    samples = {i: source.sample(int(batch_ids[i])) for i in layout.samples}
    packed = pack_samples(
        layout, {i: torch.from_numpy(s.tokens) for i, s in samples.items()},
        {i: torch.from_numpy(s.labels) for i, s in samples.items()},
        {i: torch.from_numpy(s.loss_mask) for i, s in samples.items()})
    # One non-blocking copy for the inputs and the layout's attention metadata and RoPE
    # positions, which every layer then reuses (no per-layer or per-tensor host sync); the
    # model's position ids are those positions (packed.position_ids holds the same values).
    tokens, labels, loss_mask = stage_layout(
        layout, device, (packed.tokens, packed.labels, packed.loss_mask))
    return MicroBatchInputs(
        input_ids=tokens[None], labels=labels[None], loss_mask=loss_mask[None],
        position_ids=staged_positions(layout, device)[None],
        packed_seq_params=SkrullPackedSeqParams(layout=layout, cp_group=groups.cp_group,
                                                attention_backend=attention_backend))


def pad_micro_batch(inputs: Optional[MicroBatchInputs],
                    multiple: int) -> Optional[MicroBatchInputs]:
    """Pads the stream to a multiple of ``multiple`` tokens (sequence parallelism).

    Megatron's sequence parallelism splits the stream's ``T`` tokens evenly over the TP
    ranks between the layers' TP regions (mcore asserts ``T % TP == 0`` in its
    reduce-scatter).  The padding rows go after the layout's tokens: token id 0, loss
    mask 0, position 0.  The layout (hence ``cu_seqlens``, the RoPE table and the DACP
    attention) keeps only the real tokens: ``SkrullCoreAttention`` attends over the first
    ``layout.num_tokens`` rows and returns zeros for the padding, and every other op is
    per token, so the padding changes neither the loss nor any gradient.

    Args:
        inputs: One micro-batch (``None``: the rank holds no tokens; nothing to pad).
        multiple: TP size with SP on, else 1.

    Returns:
        ``inputs`` with ``[1, T + pad]`` tensors (the same object when ``pad`` is 0).
    """
    if inputs is None or multiple <= 1:
        return inputs
    pad = -inputs.input_ids.shape[1] % multiple
    if pad == 0:
        return inputs
    grow = lambda t: torch.nn.functional.pad(t, (0, pad))  # noqa: E731 (zeros at the end)
    return dataclasses.replace(inputs, input_ids=grow(inputs.input_ids),
                               position_ids=grow(inputs.position_ids),
                               labels=grow(inputs.labels), loss_mask=grow(inputs.loss_mask))
