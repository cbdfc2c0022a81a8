"""LR schedule, temporary planner, sampler, sample sources and the log line (no processes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron.skrull._attention_fallback import build_rank_layout
from megatron.skrull.optimizer import LRSchedule, build_optimizer
from megatron.skrull.planning import greedy_plan
from megatron.skrull.samples import (ConcatSource, DatasetSource, GlobalBatchSampler,
                                     SyntheticSFTSource)
from megatron.skrull.training import IterationStats, MetricsLogger


def test_lr_schedule_shapes():
    lin = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=14, style="linear")
    assert [lin.lr_at(i) for i in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lin.lr_at(9) == pytest.approx(0.55)
    assert lin.lr_at(14) == pytest.approx(0.1) and lin.lr_at(100) == pytest.approx(0.1)
    cos = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=10, style="cosine")
    assert cos.lr_at(5) == pytest.approx(0.5) and cos.lr_at(10) == pytest.approx(0.0)
    const = LRSchedule(lr=0.3, min_lr=0.0, warmup_iters=2, decay_iters=10, style="constant")
    assert const.lr_at(1) == pytest.approx(0.15) and const.lr_at(7) == 0.3


def test_no_weight_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    from megatron.skrull.arguments import OptimArgs

    opt = build_optimizer(model, OptimArgs(lr=1e-3, train_iters=1, weight_decay=0.1))
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decay == {id(model[0].weight)}


def test_greedy_plan_is_valid_and_mixes_local_distributed_and_empty():
    lengths = np.array([300, 20, 30, 40, 250, 10, 5])
    plan = greedy_plan(lengths, dp_size=2, cp_size=2, bucket_size=200)
    plan.validate()
    mbs = [mb for rank in plan.dp_ranks for mb in rank]
    assert any(mb.distributed for mb in mbs)
    assert any(any(mb.local) for mb in mbs)
    assert len({len(rank) for rank in plan.dp_ranks}) == 1
    with pytest.raises(ValueError, match="does not fit"):
        greedy_plan([900], dp_size=1, cp_size=2, bucket_size=200)


def test_sampler_is_deterministic_epoch_aware_and_resumable():
    s = GlobalBatchSampler(10, 4, seed=3)
    batches = [next(s) for _ in range(5)]  # 20 samples = 2 epochs
    flat = sum(batches, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    resumed = GlobalBatchSampler(10, 4, seed=3)
    resumed.load_state_dict(GlobalBatchSampler(10, 4, seed=3).state_dict() | {"iteration": 3})
    assert [next(resumed) for _ in range(2)] == batches[3:]
    with pytest.raises(ValueError, match="--global-batch-size"):
        GlobalBatchSampler(10, 5, seed=3).load_state_dict(s.state_dict())


def test_synthetic_source_is_learnable_and_consistent():
    src = SyntheticSFTSource(50, 64, seed=1)
    assert src.lengths.max() == 64 and src.lengths.min() >= 8
    s = src.sample(7)
    assert len(s.tokens) == src.lengths[7]
    assert np.array_equal(s.labels[:-1], s.tokens[1:])
    assert src.num_loss_tokens(np.array([7])) == int(s.loss_mask.sum())
    body = s.tokens[2:]
    steps = np.diff(body - 10) % 54  # constant step inside a sample
    assert len(set(steps.tolist())) == 1
    assert np.array_equal(src.sample(7).tokens, SyntheticSFTSource(50, 64, seed=1).sample(7).tokens)


class _FakeDataset:
    """Mimics megatron.skrull.data.SFTDataset's causal-LM view."""

    def __init__(self, lengths, offset):
        self.lengths = np.asarray(lengths)
        self.offset = offset

    def get_example(self, i):
        n = int(self.lengths[i])
        ids = torch.arange(n) + self.offset
        return ids, ids + 1, (torch.arange(n) % 2).float()


def test_dataset_and_concat_sources():
    a, b = DatasetSource(_FakeDataset([4, 6], 0)), DatasetSource(_FakeDataset([5], 100))
    cat = ConcatSource([a, b])
    assert cat.lengths.tolist() == [4, 6, 5] and len(cat) == 3
    assert cat.num_loss_tokens(np.array([0, 1, 2])) == 2 + 3 + 2
    s = cat.sample(2)
    assert s.tokens.tolist() == [100, 101, 102, 103, 104] and s.loss_mask.dtype == np.float32


def test_fallback_layout_zigzag_and_pack():
    # Sample 0 (5 tokens) distributed over 2 ranks: padded to 8, chunks of 2; rank 1 holds
    # chunks 1 and 2 -> positions 2,3,4,5 (5 is padding); then its local sample 1.
    layout = build_rank_layout([5, 3], [0], [[], [1]], 1, 2)
    assert layout.position_ids.tolist() == [2, 3, 4, 5, 0, 1, 2]
    assert layout.is_padding.tolist() == [False, False, False, True, False, False, False]
    packed = layout.pack({0: torch.arange(5) + 10, 1: torch.arange(3) + 20}, -1)
    assert packed.tolist() == [12, 13, 14, -1, 20, 21, 22]


def test_log_line_has_every_field():
    lines = []
    log = MetricsLogger(log_interval=2, train_iters=4, enabled=True, printer=lines.append)
    for it in (1, 2):
        log.record(IterationStats(iteration=it, loss=2.0 * it, lr=1e-3, grad_norm=0.5,
                                  seconds=0.5, predicted_seconds=0.25, tokens=1000,
                                  micro_batches=3, local_share=0.75))
    assert len(lines) == 1
    line = lines[0]
    for needle in ("iteration        2/       4", "loss 3.000000E+00", "lr 1.000E-03",
                   "iteration time 500.0 ms (predicted 250.0 ms)", "tokens/s 2000",
                   "micro-batches 3.0", "local tokens 75.0%"):
        assert needle in line, line
    assert math.isfinite(IterationStats(iteration=1, loss=1, lr=1, grad_norm=1, seconds=0,
                                        predicted_seconds=None, tokens=1, micro_batches=1,
                                        local_share=0).tokens_per_second)
