"""LR schedule, batch-scheduler wiring, sample sources and the log line (no processes)."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from megatron.skrull.arguments import OptimArgs
from megatron.skrull.optimizer import build_scheduler
from megatron.skrull.batch_schedule import build_cost_model, make_batch_scheduler, predicted_seconds
from megatron.skrull.samples import DatasetSource, SyntheticSFTSource
from megatron.skrull.training import IterationStats, MetricsLogger

from mcore_helpers import tiny_config


def test_lr_schedule_is_megatrons():
    # mcore's OptimizerParamScheduler in iterations: iteration i trains with step i - 1's LR.
    def lrs(iters, **kw):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        sched = build_scheduler(opt, OptimArgs(train_iters=iters, **kw))
        out = []
        for _ in range(iters):
            out.append(opt.param_groups[0]["lr"])
            sched.step(increment=1)
        return out

    lin = lrs(14, lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_style="linear")
    assert lin[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lin[9] == pytest.approx(0.55) and lin[13] == pytest.approx(0.19)
    cos = lrs(10, lr=1.0, lr_decay_style="cosine")
    assert cos[0] == 1.0 and cos[5] == pytest.approx(0.5)
    const = lrs(4, lr=0.3, lr_warmup_iters=2, lr_decay_style="constant")
    assert const == [0.0, 0.15, 0.3, 0.3]
    # Resuming at iteration k restores step k's LR.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    build_scheduler(opt, OptimArgs(lr=1.0, min_lr=0.1, train_iters=14, lr_warmup_iters=4),
                    num_steps=9)
    assert opt.param_groups[0]["lr"] == pytest.approx(lin[9])


def test_batch_scheduler_uses_the_scheduler_and_cost_model(tmp_path):
    cfg = tiny_config(["--context-parallel-size", "2", "--global-batch-size", "8"],
                      world_size=4)
    batch_scheduler = make_batch_scheduler(cfg, vocab_size=128)
    plan = batch_scheduler(np.array([90, 12, 30, 40, 70, 10, 5, 64]))
    plan.validate()
    assert (plan.dp_size, plan.cp_size, plan.policy) == (2, 2, "skrull")
    assert predicted_seconds(plan) > 0
    # A calibrated config changes the prediction; unknown keys are rejected by name.
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"c_linear": 1e-6, "micro_batch_overhead": 1.0}))
    slow = build_cost_model(tiny_config(["--skrull-cost-model-config", str(path)]), 128)
    assert slow.time.c_linear == 1e-6 and slow.micro_batch_overhead == 1.0
    assert slow.bytes_per_element == 4  # fp32 on CPU
    path.write_text(json.dumps({"c_lin": 1.0}))
    with pytest.raises(ValueError, match="unknown keys"):
        build_cost_model(tiny_config(["--skrull-cost-model-config", str(path)]), 128)


@pytest.mark.parametrize("policy", ["per-seq-cp", "all-cp", "sorted", "kk"])
def test_baseline_policies_plan_local_or_distributed_only(policy):
    cfg = tiny_config(["--context-parallel-size", "2", "--skrull-scheduler", policy],
                      world_size=2)
    plan = make_batch_scheduler(cfg, vocab_size=128)(np.array([90, 12, 30, 40, 70, 10]))
    assert plan.policy == policy
    assert not any(mb.grouped for rank in plan.dp_ranks for mb in rank)


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


def test_dataset_source_adapts_sft_examples():
    src = DatasetSource(_FakeDataset([4, 6], 100))
    assert src.lengths.tolist() == [4, 6] and len(src) == 2
    assert src.num_loss_tokens(np.array([0, 1])) == 2 + 3
    s = src.sample(0)
    assert s.tokens.tolist() == [100, 101, 102, 103] and s.labels.tolist() == [101, 102, 103, 104]
    assert s.loss_mask.dtype == np.float32


def test_log_line_has_every_field():
    """Megatron-LM's fields with its labels, in its order (its log parsers read them), then
    Skrull's."""
    lines = []
    log = MetricsLogger(log_interval=2, train_iters=4, enabled=True, printer=lines.append)
    for it in (1, 2):
        log.record(IterationStats(iteration=it, loss=2.0 * it, lr=1e-3, grad_norm=0.5,
                                  seconds=0.5, predicted_seconds=0.25, tokens=1000,
                                  micro_batches=3, local_share=0.75, global_batch_size=8,
                                  consumed_samples=8 * it, skipped=it == 1))
    assert len(lines) == 1
    line = lines[0]
    megatron = ("iteration        2/       4 |", "consumed samples:           16 |",
                "elapsed time per iteration (ms): 500.0 |", "learning rate: 1.000000E-03 |",
                "global batch size:     8 |", "lm loss: 3.000000E+00 |", "loss scale: 1.0 |",
                "grad norm: 0.500 |", "number of skipped iterations:   1 |",
                "number of nan iterations:   0 |")
    at = [line.index(needle) for needle in megatron]
    assert at == sorted(at), line
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration", line), line
    for needle in ("predicted (ms): 250.0 |", "tokens/s: 2000 |", "micro-batches: 3.0 |",
                   "local tokens: 75.0% |"):
        assert line.index(needle) > at[-1], line
    # what a Megatron log parser looks for (e.g. Megatron-LM's dynamic-CP benchmark script)
    number = r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[Ee][+-]?\d+)?)"
    found = re.search(r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?consumed samples:\s*(\d+)\s*\|", line)
    assert found.groups() == ("2", "4", "16")
    assert float(re.search(r"elapsed time per iteration \(ms\): " + number, line)[1]) == 500.0
    assert float(re.search(r"lm loss:\s*" + number, line)[1]) == 3.0
    nan = IterationStats(iteration=3, loss=float("nan"), lr=1e-3, grad_norm=0.5, seconds=0.5,
                         predicted_seconds=None, tokens=1000, micro_batches=3, local_share=0.75)
    assert "number of nan iterations:   1 |" in log.format([nan])
    assert math.isfinite(IterationStats(iteration=1, loss=1, lr=1, grad_norm=1, seconds=0,
                                        predicted_seconds=None, tokens=1, micro_batches=1,
                                        local_share=0).tokens_per_second)
