"""Batch-size schedules through the trainer on 2 gloo ranks (DP 2, float64): each iteration
trains the scheduled global batch, the LR schedule counts consumed samples as Megatron-LM's
does, and a resume of the run's mid-ramp checkpoint has the uninterrupted run's losses and
LRs.

One spawn; two schedules: ``--step-batch-size-schedule`` with ``--train-iters`` (no
``--global-batch-size``) and the deprecated ``--rampup-batch-size`` with ``--train-samples``.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from mcore_helpers import TINY_FLAGS, drop_flag, spawn
from test_checkpointing import _load, _setup

pytestmark = pytest.mark.multiprocess

LR = 3e-3  # TINY_FLAGS' --lr (min LR 0)
CASES = {
    # 96 tokens per sample: thresholds at 4 and 12 samples; sizes 2, 2, 4, 4, 6, 6.
    "step": (["--step-batch-size-schedule", "0:2 384:4 1152:6", "--train-iters", "6",
              "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "6"],
             ["--global-batch-size"], [0, 2, 4, 8, 12, 18]),
    # mcore's ramp 2 -> 6 by 2 over 8 samples; --train-samples 30 is 6 iterations.
    "rampup": (["--rampup-batch-size", "2", "2", "8", "--train-samples", "30",
                "--lr-warmup-samples", "3"], ["--train-iters"], [0, 2, 4, 8, 14, 20]),
}
OTHER = {  # a resume with another schedule
    "step": ["--step-batch-size-schedule", "0:2 384:4 1152:5", "--train-iters", "6"],
    "rampup": ["--rampup-batch-size", "2", "1", "8", "--train-samples", "30"],
}


def _config(name, extra=None):
    """The case's configuration (``extra``: other flags than the case's own)."""
    from megatron.skrull.arguments import parse_args

    own, drop, _ = CASES[name]
    extra = own if extra is None else extra
    flags = list(TINY_FLAGS) + ["--fp64", "--lr-decay-style", "cosine"]
    for flag in drop:
        flags = drop_flag(flags, flag)
    return parse_args(flags + extra, world_size=2)


def _run(trainer, iters, save_fn=None):
    from megatron.skrull.training import train

    return [(s.loss, s.lr, s.global_batch_size)
            for s in train(trainer, train_iters=iters, save_interval=1, save_fn=save_fn)]


def _case(name, tmp):
    """The uninterrupted run (saving iteration 3, mid-ramp) and a resume of iteration 3."""
    import dataclasses

    from megatron.skrull import checkpointing as ckpt

    cfg, root = _config(name), f"{tmp}/{name}"
    trainer, desc = _setup(cfg), dataclasses.asdict(cfg)
    meta = ckpt.CheckpointMeta.from_parallel_state()
    save = lambda t: t.iteration == 3 and ckpt.save_checkpoint(root, t, meta, desc)  # noqa: E731
    full = _run(trainer, cfg.optim.train_iters, save)
    # Another schedule would change the data and LR steps: one error, nothing loaded.
    other = _config(name, OTHER[name])
    try:
        _load(root, _setup(other), other)
        refused = ""
    except ckpt.CheckpointError as exc:
        refused = str(exc)
    resumed = _setup(cfg)
    at = _load(root, resumed, cfg)
    consumed = resumed.sampler.state_dict()["consumed_samples"]
    return {"full": full, "at": at, "consumed": consumed, "refused": refused,
            "resumed": _run(resumed, cfg.optim.train_iters),
            "warmup": cfg.run.batch_sizes.lr_warmup_samples,
            "decay": cfg.run.batch_sizes.lr_decay_samples}


def _worker(rank, world, tmp):
    out = {name: _case(name, tmp) for name in CASES}
    with open(os.path.join(tmp, f"ramp_{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    spawn(_worker, 2, tmp, timeout=400)
    return [json.load(open(tmp / f"ramp_{r}.json")) for r in range(2)]


def _megatron_lr(steps, warmup, decay):
    """mcore's OptimizerParamScheduler (warmup from 0, cosine to 0) at ``steps`` samples."""
    if steps <= warmup:
        return LR * steps / warmup
    return LR * 0.5 * (math.cos(math.pi * (steps - warmup) / (decay - warmup)) + 1)


@pytest.mark.parametrize("name", list(CASES))
def test_each_iteration_trains_the_scheduled_batch_at_its_samples_lr(runs, name):
    out, consumed = runs[0][name], CASES[name][2]
    sizes = [b - a for a, b in zip(consumed, consumed[1:])] + [6]
    assert [size for _, _, size in out["full"]] == sizes
    expected = [_megatron_lr(c, out["warmup"], out["decay"]) for c in consumed]
    torch.testing.assert_close(torch.tensor([lr for _, lr, _ in out["full"]], dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert runs[1][name]["full"] == out["full"]  # every rank sees the same global numbers


@pytest.mark.parametrize("name", list(CASES))
def test_resume_mid_ramp_continues_it_exactly(runs, name):
    out = runs[0][name]
    assert out["at"] == 3 and out["consumed"] == CASES[name][2][3]
    assert "resume with the batch-size flags it was saved with" in out["refused"]
    torch.testing.assert_close(torch.tensor(out["resumed"], dtype=torch.float64),
                               torch.tensor(out["full"][3:], dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)
