"""The C++ per-call arrays of schedule() (csrc/costs.cpp) against their Python spec:
``_C.cost_arrays`` bit-identical to ``CostModel.schedule_arrays``, ``_C.sample_bounds`` to
``bound.sample_bounds``, ``_C.hybrid_floor`` to ``hybrid.hybrid_floor`` within its float
slack, and plans unchanged by any of them."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext import _backend
from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import MODEL_PRESETS, CostModel, TimeModel, default_cost_model
from skrull_ext.scheduler import SchedulerConfig, schedule
from skrull_ext.scheduler.bound import lower_bound, sample_bounds
from skrull_ext.scheduler.hybrid import hybrid_floor

pytestmark = pytest.mark.skipif(_backend.CPP is None, reason="C++ extension not built")

LENGTHS = np.array([1, 2, 3, 17, 255, 256, 1000, 4097, 65_537, 1 << 30], dtype=np.int64)


def _cost_models():
    """Both hardware presets (the cpu one has the short-block surcharge and call overheads,
    the h100 one neither), both model presets, and random coefficients with each term on
    and off, under both objectives."""
    rng = np.random.default_rng(7)
    for hardware in ("h100", "cpu"):
        for spec in MODEL_PRESETS.values():
            yield get_hardware(hardware).cost_model(spec, cp_size=8)
    for j in range(8):
        tm = TimeModel(c_linear=float(rng.uniform(1e-16, 1e-12)),
                       c_attention=float(rng.uniform(1e-16, 1e-12)),
                       micro_batch_overhead=float(rng.uniform(0, 1e-2)),
                       attention_half_tokens=float(rng.uniform(1, 4000)) if j % 2 else 0.0,
                       attention_call_overhead=float(rng.uniform(0, 1e-4)) if j % 3 else 0.0)
        yield CostModel(model=MODEL_PRESETS["qwen2.5-0.5b"], time=tm,
                        bytes_per_element=(2, 4)[j % 2], objective=("ring", "paper")[j % 2])


@pytest.mark.parametrize("cp", [1, 2, 3, 8, 16])
def test_cost_arrays_are_bit_identical_to_numpy(cp):
    for cost_model in _cost_models():
        want = cost_model.schedule_arrays(LENGTHS, cp)
        got = cost_model.schedule_arrays(LENGTHS, cp, backend="cpp")
        for name, a, b in zip(("costs", "comm", "shares"), got, want):
            assert a.dtype == np.float64 and a.shape == LENGTHS.shape
            assert np.array_equal(a, b), (name, cp, cost_model.time)



@pytest.mark.parametrize("cp, bucket", [(1, 70_000), (2, 5000), (3, 700), (8, 2000), (16, 1024)])
def test_sample_bounds_are_bit_identical_to_numpy(cp, bucket):
    """Every cost model, with and without sub-groups and the caller's arrays; samples that
    fit no group size keep inf in both."""
    rng = np.random.default_rng(cp)
    lengths = np.concatenate([LENGTHS[:-1], rng.integers(1, 40_000, 300)])
    for cm in _cost_models():
        arrays = (cm.compute_seconds(lengths), cm.share_seconds(lengths, cp),
                  cm.comm_seconds(lengths, cp))
        for subgroups in (True, False):
            for given in (None, arrays):
                kw = dict(arrays=given, subgroups=subgroups)
                want = sample_bounds(lengths, cm, cp, bucket, **kw)
                got = sample_bounds(lengths, cm, cp, bucket, backend="cpp", **kw)
                for w, g in zip(want, got):
                    assert w.dtype == g.dtype == np.float64
                    assert np.array_equal(w, g), (cp, bucket, cm.objective, subgroups)
        fits = lengths <= cp * bucket  # the lower bound's precondition, roughly
        args = (lengths[fits], cm, 3, cp, bucket)
        assert lower_bound(*args, backend="cpp") == lower_bound(*args)


def test_sample_bounds_reject_bad_input():
    cm = default_cost_model()
    args = (LENGTHS, 4, 1000, cm.cost_scalars, [1, 2, 4], [1.0, 2.0], [0.0, 0.0, 0.0], True)
    with pytest.raises(ValueError, match="one entry per group size"):
        _backend.CPP.sample_bounds(*args)
    with pytest.raises(ValueError, match="costs must be a 1-D array"):
        _backend.CPP.sample_bounds(*args[:5], [1.0] * 3, *args[6:], np.zeros(3))


def test_cost_arrays_reject_bad_input():
    scalars = default_cost_model().cost_scalars
    with pytest.raises(ValueError, match="1-D"):
        _backend.CPP.cost_arrays(LENGTHS.reshape(2, -1), 2, scalars, 1.0)
    with pytest.raises(ValueError, match="cost_scalars"):
        _backend.CPP.cost_arrays(LENGTHS, 2, scalars[:-1], 1.0)


def test_cost_scalars_follow_a_replaced_time_model():
    """cost_scalars is cached per CostModel; a replaced model computes its own."""
    cost_model = default_cost_model()
    faster = dataclasses.replace(cost_model, time=dataclasses.replace(
        cost_model.time, c_linear=cost_model.time.c_linear / 2))
    assert faster.cost_scalars != cost_model.cost_scalars
    assert np.array_equal(faster.schedule_arrays(LENGTHS, 4, backend="cpp")[0],
                          faster.schedule_arrays(LENGTHS, 4)[0])


@pytest.mark.parametrize("k, dp", [(3, 4), (4, 4), (257, 4), (1000, 3), (5000, 8)])
def test_hybrid_floor_matches_python(k, dp):
    rng = np.random.default_rng(k)
    cost_model = get_hardware("cpu").cost_model(MODEL_PRESETS["qwen2.5-0.5b"], cp_size=8)
    lengths = np.minimum(np.ceil(200 * (1 + rng.pareto(1.1, k))), 60_000).astype(np.int64)
    for cp, bucket in ((4, 16_000), (8, 8_000), (16, 4_000)):
        cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket)
        costs = cost_model.compute_seconds(lengths)
        want = hybrid_floor(lengths, cfg, cost_model, costs)
        got = _backend.CPP.hybrid_floor(lengths, costs, dp, cp, bucket,
                                        cost_model.micro_batch_overhead,
                                        cost_model.time.iteration_overhead)
        # numpy sums pairwise, the C++ in sample order: a few ulps apart at most.
        assert got == pytest.approx(want, rel=1e-13, abs=0)
        assert (got == 0.0) == (k < dp)


def test_plans_do_not_depend_on_where_the_arrays_are_computed(monkeypatch):
    """schedule() on the C++ backend (C++ arrays and floor) keeps the plans and predictions
    of the Python arrays fed to the same core, hybrid CP's candidate included."""
    from skrull_ext.scheduler import dyncp, groupfill

    # Dynamic CP's candidate, re-dealt, would win both batches; hybrid CP's floor is tested.
    monkeypatch.setattr(dyncp, "candidate", lambda *args: None)
    monkeypatch.setattr(groupfill, "candidate", lambda *args: None)  # tests/test_groupfill.py
    rng = np.random.default_rng(1)
    cost_model = get_hardware("cpu").cost_model(MODEL_PRESETS["qwen2.5-0.5b"], cp_size=8)
    candidates = set()
    for cp, bucket in ((4, 3000), (8, 2000)):
        lengths = np.minimum(np.ceil(200 * (1 + rng.pareto(1.1, 512))),
                             cp * bucket - 2 * cp).astype(np.int64)
        cfg = SchedulerConfig(dp_size=2, cp_size=cp, bucket_size=bucket)
        native = schedule(lengths, cfg, cost_model, backend="cpp")
        spec = schedule(lengths, cfg, cost_model, backend="python")
        assert native.dp_ranks == spec.dp_ranks
        assert native.predicted["iteration_time"] == spec.predicted["iteration_time"]
        assert native.predicted.get("candidate") == spec.predicted.get("candidate")
        candidates.add(native.predicted.get("candidate"))
    assert candidates == {None, "hybrid-cp"}  # Skrull's own plan once, hybrid CP's once
