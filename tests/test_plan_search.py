"""The stronger search of benchmarks/plan_quality.py (benchmarks/plan_search.py, plan_milp.py).

Ruin and recreate repairs a plan that leaves a DP rank idle and returns a valid plan never
predicted slower; the MILP repair, freeing every sample of a tiny batch, reaches the
optimum that enumerating every placement finds; plan_quality runs the search end to end.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import numpy as np
import pytest

from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.scheduler.pricing import predict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
try:  # plan_quality imports the other two lazily: they are in sys.modules from here on
    import plan_milp
    import plan_quality
    import plan_search
finally:
    sys.path.pop(0)


def _plan(lengths, dp_ranks, cp: int, bucket: int, cm) -> Plan:
    plan = Plan(lengths=np.asarray(lengths, dtype=np.int64), dp_size=len(dp_ranks), cp_size=cp,
                bucket_size=bucket, policy="skrull",
                dp_ranks=tuple(tuple(MicroBatch(tuple(d), tuple(map(tuple, loc)))
                                     for d, loc in rank) for rank in dp_ranks))
    plan.validate()
    plan.predicted.update(predict(plan, cm))
    return plan


def test_ruin_and_recreate_balances_an_idle_rank():
    """Every sample on DP rank 0: the search moves work to rank 1 and never returns a
    slower or invalid plan."""
    cm = dataclasses.replace(default_cost_model(), objective="ring")
    lengths = [3000, 2500, 2000, 1500, 1200, 900, 700, 400]
    start = _plan(lengths, [[([0], [[1, 2], [3, 4, 5, 6, 7]])], [([], [[], []])]], 2, 8000, cm)
    out = plan_search.search(start, cm, 0.5, milp=False)
    out.validate()
    assert out.predicted["iteration_time"] < 0.8 * start.predicted["iteration_time"]
    assert sorted(i for mbs in out.dp_ranks for mb in mbs for i in mb.samples()) == list(range(8))


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_milp_repair_reaches_the_enumerated_optimum(objective):
    """Four samples, two DP ranks, CP 2: freeing all of them, one repair finds the best
    of every placement (each sample distributed or on a CP rank, in either DP rank's
    micro-batch or a second one), as enumeration does."""
    pytest.importorskip("scipy")
    cm = dataclasses.replace(default_cost_model(), objective=objective)
    lengths = np.array([6000, 2500, 1800, 700], dtype=np.int64)
    cp, bucket = 2, 6000
    start = _plan(lengths, [[([0], [[1], [2]])], [([], [[3], []])]], cp, bucket, cm)
    costs, comm, shares = cm.schedule_arrays(lengths, cp)
    batch = plan_milp._Batch(lengths, costs, comm, shares, cm.comm_latency(cp),
                             cm.micro_batch_overhead, cp, bucket, objective)
    state = plan_milp._Plan(batch, plan_milp._plan_lists(start))
    slots = [(0, 0), (0, None), (1, 0), (1, None)]
    pool = [(0, 0, 0, -1), (1, 0, 0, 0), (2, 0, 0, 1), (3, 1, 0, 0)]
    where, timed_out, fixed = plan_milp._repair(state, [0, 1], slots, pool, 30.0)
    assert not timed_out and where is not None
    new, times = plan_milp._apply(state, slots, pool, where, fixed)
    got = max(times[0] + times[1], times[2] + times[3])
    best = np.inf
    for pos in itertools.product(range(len(slots)), range(-1, cp), repeat=len(lengths)):
        mbs = [[[], [[] for _ in range(cp)]] for _ in slots]
        for i in range(len(lengths)):
            s, r = pos[2 * i], pos[2 * i + 1]
            (mbs[s][0] if r < 0 else mbs[s][1][r]).append(i)
        if max(max(batch.tokens(mb)) for mb in mbs) > bucket:
            continue
        t = [batch.time(mb) for mb in mbs]
        best = min(best, max(t[0] + t[1], t[2] + t[3]))
    assert got == pytest.approx(best, rel=1e-6)


def test_plan_quality_reports_the_search(capsys, tmp_path, monkeypatch):
    """One small setting end to end: the search columns and their summary line."""
    monkeypatch.setenv("SKRULL_RESULTS_DIR", str(tmp_path))
    assert plan_quality.main(["--profiles", "lmsyschat1m", "--models", "qwen2.5-0.5b",
                              "--cp", "4", "--gbs", "64", "--buckets", "1", "--num-batches", "1",
                              "--search-budget-ms", "5", "--search-time-s", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "stronger search: faster than skrull by > 1% in" in out
    assert "the MILP repairs improved" in out
