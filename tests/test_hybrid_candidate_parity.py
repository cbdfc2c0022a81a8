"""The hybrid-CP candidate built and priced in the C++ core (``_C.hybrid_candidate``) against
the Python build, the spec (``scheduler.hybrid._build_python`` on the pure-Python grouping): the
same plan, bit-identical predictions, the same winner, on random batches with CP
3/4/6/8/16, several buckets and DP sizes, both objectives."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import skrull_ext.scheduler as sched
from skrull_ext.scheduler import dyncp, groupfill, hybrid
from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig
from skrull_ext.scheduler.plan import FlatPlan
from tests._parity import assert_same_plan

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")


def _batches(seed: int, count: int):
    """``(lengths, config, cost_model)`` with CP 3-16, buckets 256-2048, DP 1-4, both
    objectives; lengths log-normal (many longer than the bucket), each fits distributed."""
    rng = np.random.default_rng(seed)
    for j in range(count):
        cp, bucket = (4, 8, 16, 3, 6)[j % 5], (256, 512, 1024, 2048)[j // 5 % 4]
        cm = dataclasses.replace(default_cost_model(), objective=("paper", "ring")[j % 2])
        k = int(rng.integers(8, 300))
        lengths = np.exp(rng.normal(6.3, 1.3, k)).astype(np.int64) + 1
        lengths = np.minimum(lengths, cp * bucket - 2 * cp)
        yield lengths, SchedulerConfig(dp_size=1 + j % 4, cp_size=cp, bucket_size=bucket), cm


def _both(monkeypatch, lengths, cfg, cm, best):
    """(C++ build, Python spec build) of hybrid CP's plan against Skrull's time ``best``."""
    arrays = (cm.compute_seconds(lengths), cm.share_seconds(lengths, cfg.cp_size),
              cm.comm_seconds(lengths, cfg.cp_size))
    sub = hybrid.subgroup_arrays(lengths, cfg.cp_size, cfg.bucket_size, cm)
    monkeypatch.setattr(_backend, "CPP", _C)
    fast = hybrid._build_cpp(lengths, cfg, cm, arrays, sub, best)
    monkeypatch.setattr(_backend, "CPP", None)  # the pure-Python grouping too
    slow = hybrid._build_python(lengths, cfg, cm, arrays, sub, best)
    monkeypatch.setattr(_backend, "CPP", _C)
    return fast, slow


def test_cpp_candidate_is_the_python_plan_bit_for_bit(monkeypatch):
    grouped = 0
    for lengths, cfg, cm in _batches(0, 40):
        (plan, predicted), (ref, ref_predicted) = _both(monkeypatch, lengths, cfg, cm, np.inf)
        flat = assert_same_plan(plan, predicted, ref, ref_predicted, cfg)
        # The core's placement check agrees with the vectorised one; buckets hold.
        plan.__dict__["flat"] = dataclasses.replace(flat, verified=False)
        plan.validate()
        assert plan.rank_tokens().max() <= cfg.bucket_size
        grouped += any(mb.grouped for mbs in plan.dp_ranks for mb in mbs)
    assert grouped >= 30  # sub-group rings priced in most batches


def test_cpp_candidate_gives_up_only_when_it_cannot_win(monkeypatch):
    for lengths, cfg, cm in _batches(1, 12):
        _, (_, ref) = _both(monkeypatch, lengths, cfg, cm, np.inf)
        t = ref["iteration_time"]
        assert _both(monkeypatch, lengths, cfg, cm, t * (1 - 1e-6))[0] is None
        # Within the margin it hands the plan over and Python decides (not faster: kept out).
        assert _both(monkeypatch, lengths, cfg, cm, t)[0][1]["iteration_time"] == t


def test_both_backends_pick_the_same_winner(monkeypatch):
    """``hybrid.candidate`` against Skrull's time moved around hybrid CP's: the C++ and
    Python paths keep the same plan (or both keep Skrull's: ``None``)."""
    kept = 0
    for lengths, cfg, cm in _batches(2, 18):
        own = sched.schedule(lengths, dataclasses.replace(cfg, subgroups=False), cm)
        _, (_, ref) = _both(monkeypatch, lengths, cfg, cm, np.inf)
        t = ref["iteration_time"]
        arrays = (cm.compute_seconds(lengths), cm.share_seconds(lengths, cfg.cp_size),
                  cm.comm_seconds(lengths, cfg.cp_size))
        for best in (own.predicted["iteration_time"], t, t * (1 + 1e-12), t * 1.01, t * 0.99):
            fast = hybrid.candidate(lengths, best, cfg, cm, arrays, "cpp")
            monkeypatch.setattr(_backend, "CPP", None)
            slow = hybrid.candidate(lengths, best, cfg, cm, arrays, "python")
            monkeypatch.setattr(_backend, "CPP", _C)
            assert (fast is None) == (slow is None)
            if fast is None:  # it cannot win, or the gate bounding hybrid CP's own deal
                assert best <= t or best <= hybrid.hybrid_bound(lengths, cfg, cm, arrays)
                continue
            kept += 1
            assert fast.dp_ranks == slow.dp_ranks and fast.predicted == slow.predicted
            assert fast.predicted["candidate"] == "hybrid-cp" and best > t
            assert isinstance(fast.flat, FlatPlan)
    assert kept >= 10


def test_schedule_same_plan_on_both_backends_when_hybrid_cp_wins(monkeypatch):
    # Megatron's dynamic-CP plan would beat hybrid CP's here (tests/test_dyncp_candidate.py).
    monkeypatch.setattr(dyncp, "candidate", lambda *args: None)
    cm = default_cost_model()
    rng = np.random.default_rng(5)
    lengths = np.minimum(np.exp(rng.normal(6.8, 1.1, 400)).astype(np.int64) + 1, 7000)
    cfg = SchedulerConfig(dp_size=2, cp_size=8, bucket_size=1024)
    a = sched.schedule(lengths, cfg, cm, backend="cpp")
    b = sched.schedule(lengths, cfg, cm, backend="python")
    assert a.predicted.get("candidate") == "hybrid-cp"
    assert a.dp_ranks == b.dp_ranks and a.predicted == b.predicted


def test_cpp_schedule_gates_hybrid_cp_before_building_skrulls_plan(monkeypatch):
    """On the C++ backend ``schedule()`` asks hybrid CP's candidate on the core's
    micro-batch times before building Skrull's plan: the result is the staged one
    (Skrull's plan, then ``hybrid.candidate`` on its prediction), and where hybrid CP wins
    none of Skrull's micro-batches becomes a Python object."""
    from skrull_ext.scheduler.plan import MicroBatch

    monkeypatch.setattr(dyncp, "candidate", lambda *args: None)  # hybrid CP's staging only
    monkeypatch.setattr(groupfill, "candidate", lambda *args: None)  # tests/test_groupfill.py
    built = []
    trusted = MicroBatch.trusted.__func__
    monkeypatch.setattr(MicroBatch, "trusted",
                        classmethod(lambda cls, *a: built.append(1) or trusted(cls, *a)))
    wins = losses = 0
    for lengths, cfg, cm in _batches(3, 20):
        own = sched.schedule(lengths, dataclasses.replace(cfg, subgroups=False), cm,
                             backend="cpp")
        arrays = (cm.compute_seconds(lengths), cm.share_seconds(lengths, cfg.cp_size),
                  cm.comm_seconds(lengths, cfg.cp_size))
        staged = hybrid.candidate(lengths, own.predicted["iteration_time"], cfg, cm, arrays,
                                  "cpp")
        built.clear()
        got = sched.schedule(lengths, cfg, cm, backend="cpp")
        want = own if staged is None else staged
        assert got.dp_ranks == want.dp_ranks and got.predicted == want.predicted
        if staged is None:
            losses += 1
            assert len(built) == got.num_micro_batches * cfg.dp_size  # Skrull's, built once
        else:
            wins += 1
            assert not built and got.predicted["candidate"] == "hybrid-cp"
    assert wins >= 3 and losses >= 3
