"""Planning ahead on a worker thread, the per-iteration plan checksum, the online refit.

Overlap is proven by order of operations (the worker plans batch i+1 while the main
thread is still inside iteration i), never by timing.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from mcore_helpers import spawn, tiny_config
from megatron.skrull.batch_schedule import make_batch_scheduler
from megatron.skrull.data import GlobalBatchSampler
from megatron.skrull.plan_ahead import (PlanMismatchError, PlannedBatches, agree_on_plan,
                                        plan_checksum)
from skrull_ext.scheduler import predict
from skrull_ext.scheduler.plan import MicroBatch, Plan

VOCAB = 128
RNG = np.random.default_rng(3)
LENGTHS = np.concatenate([RNG.integers(8, 60, size=60), [400, 700, 1000, 90]])


def _scheduler(online: bool):
    flags = ["--global-batch-size", "8", "--context-parallel-size", "2",
             "--skrull-bucket-size", "512", "--skrull-hardware", "cpu"]
    if online:
        flags.append("--skrull-online-cost-model")
    return make_batch_scheduler(tiny_config(flags, world_size=4), VOCAB)


SEED = _scheduler(False).cost_model


def _true_seconds(plan: Plan, i: int) -> float:
    """A fake machine 2.5x slower than the preset, plus ~35 ms per iteration."""
    return 2.5 * predict(plan, SEED)["iteration_time"] + 0.03 + 0.01 * (i % 2)


def _run(ahead: bool, online: bool, iters: int = 6):
    """The Trainer's loop order: take, agree/observe the last one, prefetch, train."""
    sched = _scheduler(online)
    batches = PlannedBatches(GlobalBatchSampler(len(LENGTHS), 8, 1), LENGTHS, sched,
                             ahead=ahead)
    out, last = [], None
    for i in range(iters):
        ids, plan = batches.take()
        if last is not None:
            sched.observe(last, _true_seconds(last, i))
        batches.prefetch()
        out.append((ids.tolist(), plan_checksum(plan), plan.predicted.get("iteration_time")))
        last = plan
    batches.close()
    return out, sched


@pytest.mark.parametrize("online", [False, True])
def test_ahead_plans_equal_inline_plans(online):
    inline, _ = _run(ahead=False, online=online)
    ahead, _ = _run(ahead=True, online=online)
    assert inline == ahead
    assert len({c for _, c, _ in inline}) > 1  # different batches, different plans


def test_online_refit_follows_a_slower_machine():
    _, sched = _run(ahead=False, online=True, iters=8)
    assert sched.cost_model != SEED
    for start in (0, 8, 16):  # fresh batches: refit predictions within 10% of "measured"
        plan = sched(LENGTHS[start:start + 8])
        truth = 2.5 * predict(plan, SEED)["iteration_time"] + 0.035
        assert abs(plan.predicted["iteration_time"] / truth - 1) < 0.10
        assert abs(predict(plan, SEED)["iteration_time"] / truth - 1) > 0.5  # seed was off


def test_worker_plans_next_batch_while_this_one_trains():
    calls, second = [], threading.Event()
    inner = _scheduler(False)

    def scheduler(lengths):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            second.set()
        return inner(lengths)

    batches = PlannedBatches(GlobalBatchSampler(len(LENGTHS), 8, 1), LENGTHS, scheduler,
                             ahead=True)
    batches.take()  # batch 1: nothing pending yet, planned inline
    batches.prefetch()
    # Still "inside iteration 1" (take() of batch 2 not called): the worker plans batch 2.
    assert second.wait(30)
    assert calls[1].startswith("skrull-plan") and not calls[0].startswith("skrull-plan")
    batches.take()
    batches.close()


def test_checkpoint_state_undoes_the_batch_drawn_ahead():
    sampler = GlobalBatchSampler(len(LENGTHS), 8, 1)
    batches = PlannedBatches(sampler, LENGTHS, _scheduler(False), ahead=True)
    batches.take()
    batches.prefetch()
    state = batches.state_dict()
    ids2, plan2 = batches.take()
    resumed = PlannedBatches(GlobalBatchSampler(len(LENGTHS), 8, 1), LENGTHS,
                             _scheduler(False), ahead=True)
    resumed.load_state_dict(state)
    ids, plan = resumed.take()
    assert ids.tolist() == ids2.tolist() and plan_checksum(plan) == plan_checksum(plan2)
    for b in (batches, resumed):
        b.close()


def _plan(local):
    mb = MicroBatch(distributed=(), local=local)
    return Plan(lengths=np.array([5, 6, 7]), dp_size=1, cp_size=2, bucket_size=64,
                policy="test", dp_ranks=((mb,),))


def test_checksum_sees_every_placement_change():
    a = _plan(((0, 1), (2,)))
    assert plan_checksum(a) == plan_checksum(_plan(((0, 1), (2,))))
    assert plan_checksum(a) != plan_checksum(_plan(((0,), (1, 2))))
    assert plan_checksum(a) != plan_checksum(dataclasses.replace(a, lengths=np.array([5, 6, 8])))
    assert 0 <= plan_checksum(a) < 2 ** 63


def _agree_worker(rank, world, tmp):
    import torch

    same = agree_on_plan(_plan(((0, 1), (2,))), iteration=1, device=torch.device("cpu"),
                         measured_seconds=1.0 + rank)
    assert same == 2.0  # the max over ranks reaches everyone
    other = _plan(((0, 1), (2,))) if rank == 0 else _plan(((0,), (1, 2)))
    with pytest.raises(PlanMismatchError, match="different Skrull plans"):
        agree_on_plan(other, iteration=2, device=torch.device("cpu"))
    open(f"{tmp}/ok{rank}", "w").close()


@pytest.mark.multiprocess
def test_plan_mismatch_is_one_clear_error_on_every_rank(tmp_path):
    spawn(_agree_worker, 2, tmp_path, timeout=240)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_flags(monkeypatch):
    from megatron.skrull.batch_schedule import online_refit

    cfg = tiny_config()
    assert cfg.skrull.plan_ahead and cfg.skrull.online_cost_model is None
    assert not online_refit(cfg)  # the default on CPU: deterministic plans
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert online_refit(dataclasses.replace(cfg, device="cuda"))  # the default on CUDA
    assert not online_refit(tiny_config(["--no-skrull-online-cost-model"]))
    cfg = tiny_config(["--no-skrull-plan-ahead", "--skrull-online-cost-model"])
    assert not cfg.skrull.plan_ahead and cfg.skrull.online_cost_model
    assert make_batch_scheduler(cfg, VOCAB).refit is not None
