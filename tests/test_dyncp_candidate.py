"""Megatron's dynamic-CP plan as Skrull's candidate (``scheduler.dyncp``): the C++ build
(``_C.dyncp_candidate``, csrc/dyncp.cpp) against the Python spec (the ``dynamic-cp``
baseline's code, ``predict_arrays``) bit for bit, and ``schedule()`` never predicted slower
than the ``dynamic-cp`` baseline on either backend, both objectives."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, dyncp, hybrid, schedule
from skrull_ext.scheduler.baselines import BASELINES
from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.scheduler.pricing import predict_arrays
from tests._parity import assert_same_plan

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")


def _batches(seed: int, count: int):
    """``(lengths, config, cost_model)``: CP 2/3/4/6/8/16, buckets 256-2048, DP 1-4, both
    objectives; log-normal lengths (many longer than the bucket), each fits distributed."""
    rng = np.random.default_rng(seed)
    for j in range(count):
        cp, bucket = (4, 8, 16, 2, 3, 6)[j % 6], (256, 512, 1024, 2048)[j // 6 % 4]
        cm = dataclasses.replace(default_cost_model(), objective=("paper", "ring")[j % 2])
        k = int(rng.integers(1, 260))
        lengths = np.exp(rng.normal(6.3, 1.4, k)).astype(np.int64) + 1
        lengths = np.minimum(lengths, cp * bucket - 2 * cp)
        yield lengths, SchedulerConfig(dp_size=1 + j % 4, cp_size=cp, bucket_size=bucket), cm


def _arrays(lengths, cfg, cm):
    costs, comm, shares = cm.schedule_arrays(lengths, cfg.cp_size)
    return costs, shares, comm


def test_cpp_candidate_is_the_python_plan_bit_for_bit():
    grouped = dealt = 0
    for lengths, cfg, cm in _batches(0, 48):
        arrays = _arrays(lengths, cfg, cm)
        plan, predicted = dyncp._build_cpp(lengths, cfg, cm, arrays, np.inf)
        ref, ref_predicted = dyncp._build_python(lengths, cfg, cm, arrays, np.inf)
        flat = assert_same_plan(plan, predicted, ref, ref_predicted, cfg)
        grouped += bool(flat.grouped)
        # Megatron's own plan (the baseline) is never faster; re-dealt, it is slower.
        megatron = _megatron_plan(lengths, cfg, cm, arrays)
        assert predicted["iteration_time"] <= megatron["iteration_time"]
        dealt += predicted["iteration_time"] < megatron["iteration_time"]
        # The core hands nothing over when the plan cannot come within 1e-9 of the limit.
        limit = predicted["iteration_time"] * (1.0 - 1e-6)
        assert dyncp._build_cpp(lengths, cfg, cm, arrays, limit) is None
    assert grouped >= 10  # sub-group rings were exercised, not only local / distributed
    assert dealt >= 20  # the re-deal too (30 of the 36 batches with DP > 1)


def _megatron_plan(lengths, cfg, cm, arrays):
    """``predict`` of the ``dynamic-cp`` baseline's plan as Megatron deals it."""
    costs, shares, comm = arrays
    ranks = BASELINES["dynamic-cp"](lengths, costs, cfg.dp_size, cfg.cp_size, cfg.bucket_size)
    m = max(1, max(len(r) for r in ranks))
    ranks = tuple(tuple(r) + (MicroBatch.empty(cfg.cp_size),) * (m - len(r)) for r in ranks)
    plan = Plan(lengths=lengths, dp_size=cfg.dp_size, cp_size=cfg.cp_size,
                bucket_size=cfg.bucket_size, policy="dynamic-cp", dp_ranks=ranks)
    return predict_arrays(plan, cm, costs, comm, shares)


def test_dealing_is_longest_first_and_only_when_faster():
    # 3 and 3 on rank 0, 1 and 1 on rank 1: dealt longest first -> 3 + 1 on each.
    assert hybrid.dealt([[3.0, 3.0], [1.0, 1.0]]) == [[0, 2], [1, 3]]
    # Ties go to the lower index and the lower rank; a full rank (M = 3) takes no more, so
    # the empty micro-batches (0 s) fill rank 0.
    assert hybrid.dealt([[4.0, 2.0, 1.0], [1.0, 0.0, 0.0]]) == [[0, 4, 5], [1, 2, 3]]
    assert hybrid.dealt([[2.0, 1.0], [2.0, 1.0]]) is None  # balanced already
    assert hybrid.dealt([[4.0, 0.0], [0.0, 0.0]]) is None  # one indivisible micro-batch


def test_cpp_world_groups_match_the_reference_at_every_block():
    """The grouping alone, Megatron's own world-wide rule included (``block = D N``)."""
    from skrull_ext.scheduler.megatron_packing import dynamic_cp_world

    for lengths, cfg, _ in _batches(1, 24):
        d, n, c = cfg.dp_size, cfg.cp_size, cfg.bucket_size
        for block in (n, d * n):
            got = _C.dyncp_world(lengths, d, n, c, block)
            assert got == [[(f, s, tuple(ids)) for f, s, ids in mb]
                           for mb in dynamic_cp_world(lengths, d, n, c, block)], (block, cfg)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_schedule_never_slower_than_dynamic_cp(backend, monkeypatch):
    wins = 0
    for lengths, cfg, cm in _batches(2, 36):
        base = schedule(lengths, dataclasses.replace(cfg, policy="dynamic-cp"), cm,
                        backend=backend)
        plan = schedule(lengths, cfg, cm, backend=backend)
        assert plan.policy == "skrull"
        assert plan.predicted["iteration_time"] <= base.predicted["iteration_time"]
        assert plan.predicted["iteration_time"] >= plan.predicted["lower_bound"]
        wins += plan.predicted.get("candidate") == "dynamic-cp"
    assert wins >= 3  # the candidate is what closes the gap on some of these


def test_floor_is_below_the_dynamic_cp_plan_and_gates_apply(monkeypatch):
    for lengths, cfg, cm in _batches(3, 24):
        arrays = _arrays(lengths, cfg, cm)
        _, predicted = dyncp._build_python(lengths, cfg, cm, arrays, np.inf)
        assert dyncp.dyncp_floor(lengths, cfg, cm, arrays[0]) <= predicted["iteration_time"]
    lengths, cfg, cm = next(_batches(4, 1))
    arrays = _arrays(lengths, cfg, cm)
    assert dyncp.candidate(lengths, 0.0, cfg, cm, arrays, "cpp") is None  # nothing beats 0
    off = dataclasses.replace(cfg, subgroups=False)
    assert dyncp.candidate(lengths, np.inf, off, cm, arrays, "cpp") is None
    monkeypatch.setattr(dyncp, "MAX_DYNCP_SAMPLES", lengths.size - 1)
    assert dyncp.candidate(lengths, np.inf, cfg, cm, arrays, "cpp") is None


@pytest.mark.parametrize("name", ["hybrid_candidate", "dyncp_candidate"])
def test_core_candidates_refuse_bad_arguments(name):
    """Both C++ candidates share one set of checks (csrc/hybrid_bindings.cpp): a sample
    that cannot fit the bucket, non-finite seconds, a bad range and a micro-batch that is
    no class each fail with one error naming the cause."""
    cm = default_cost_model()
    n, k = 4, 5
    lengths = np.full(k, 100, dtype=np.int64)
    costs, comm, shares = cm.schedule_arrays(lengths, n)
    rows = 1 if name == "dyncp_candidate" else None  # sub-group sizes 2 < 4
    sub = np.zeros((rows, k)) if rows else np.zeros(k)

    def call(lengths=lengths, costs=costs, cp=n, bucket=64, cls=None):
        return getattr(_C, name)(lengths, costs, shares, comm, sub, sub, np.zeros(cp + 1),
                                 0.0, 1, cp, bucket, 0.0, 0.0, 1, 1.0, micro_batch=cls)

    call()  # the valid call runs
    with pytest.raises(ValueError, match="sample 2 of length 9000 does not fit"):
        call(lengths=np.array([100, 100, 9000, 100, 100], dtype=np.int64))
    with pytest.raises(ValueError, match=r"costs\[1\] is not finite"):
        call(costs=np.array([1.0, np.nan, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="bucket_size"):
        call(bucket=0)
    with pytest.raises(TypeError, match="micro_batch must be a class"):
        call(cls=3)


def test_galloping_scan_keeps_megatrons_groups():
    """The C++ core finds each round's next sample by a galloping search (a sample fits iff
    it is no longer than a threshold) and the spec stops its scan once the smallest fits
    nowhere: Megatron's rounds stay the same, on large batches with many equal padded
    lengths, blocks of N (Skrull's candidate) and of D x N (Megatron's own rule)."""
    from skrull_ext.scheduler.megatron_packing import dynamic_cp_world

    rng = np.random.default_rng(3)
    for k, dp, cp, bucket in ((3000, 4, 8, 1024), (1500, 2, 4, 512), (800, 3, 2, 2048)):
        lengths = np.minimum((120 * (1 + rng.pareto(1.1, k))).astype(np.int64),
                             cp * bucket - 2 * cp)
        for block in (cp, dp * cp):
            want = [[(f, s, tuple(ids)) for f, s, ids in mb]
                    for mb in dynamic_cp_world(lengths, dp, cp, bucket, block)]
            got = [[(f, s, tuple(ids)) for f, s, ids in mb]
                   for mb in _C.dyncp_world(lengths, dp, cp, bucket, block)]
            assert got == want, (k, dp, cp, bucket, block)
