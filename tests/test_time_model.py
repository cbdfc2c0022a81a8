"""One time model: the scheduler's prediction and the planner's simulator compose the same
terms (docs/scheduler.md, "One time model"), in Python and in the C++ core alike."""
from __future__ import annotations

import numpy as np
import pytest

from skrull_ext.costmodel.hardware import CPU, H100
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.profiles import load_profile, sample_global_batches
from skrull_ext.planner.simulator import simulate
from skrull_ext.scheduler import SchedulerConfig, reference, schedule
from skrull_ext.scheduler.objective import Objective, objective_arg, objective_of, rank_times

SMALL = MODEL_PRESETS["qwen2.5-0.5b"]
ALL_CP = ("all-cp", "kk", "sorted", "dp-balanced", "wlb-llm")  # no local work anywhere


def _batches(cp: int, bucket: int):
    for name in ("lmsyschat1m", "chatqa2-long-sft"):
        yield from sample_global_batches(load_profile(name), num_batches=1, global_batch_size=96,
                                         seed=5, max_length=cp * bucket,
                                         overflow="truncate").batches


@pytest.mark.parametrize("name", ["paper", "ring"])
def test_vectorised_rank_time_is_the_spec_bit_for_bit(name):
    rng = np.random.default_rng(0)
    lam, beta, ell, o = 2e-7, 3e-8, 4e-5, 1e-5
    objective = Objective(name, (lam, beta, ell, o, 1 / 3.5))
    for n in (1, 2, 3, 8):
        # Sums as a cost model makes them: shard tokens S, attention blocks, local work.
        tokens = rng.integers(0, 20000, 50)
        att, x = rng.exponential(0.01, (2, 50))
        comm = (3 * (n - 1) * beta + lam + beta) * tokens + (2 * n - 1) * ell + n * o
        dist = att + (lam + beta) * tokens
        comm[::5] = 0.0  # nothing distributed
        dist[::5] = 0.0
        want = [reference.rank_time(a, b, c, n, objective) for a, b, c in zip(x, comm, dist)]
        assert rank_times(x, comm, dist, n, objective).tolist() == want
        assert all(t >= a for t, a in zip(want, x))  # never below the local work
        assert want[0] == x[0] + dist[0]  # nothing distributed: local work and t_dist


def test_core_prices_a_micro_batch_like_the_spec():
    _C = pytest.importorskip("skrull_ext._C")
    cost = H100.cost_model(SMALL, 4, 2)
    rng = np.random.default_rng(1)
    lengths = rng.integers(16, 9000, 40)
    costs, comm, shares = cost.schedule_arrays(lengths, 4)
    objective = objective_of(cost)
    for _ in range(50):
        ids = rng.permutation(40)[:int(rng.integers(1, 12))].tolist()
        dist = ids[:int(rng.integers(0, len(ids) + 1))]
        local = [ids[len(dist) + r::4] for r in range(4)]
        want = reference.micro_batch_time((dist, local), costs, comm,
                                          cost.comm_latency(4), 4, shares, objective)
        got = _C.micro_batch_time((np.array(dist, dtype=np.int64),
                                   [np.array(r, dtype=np.int64) for r in local]),
                                  costs, comm, cost.comm_latency(4), 4, shares,
                                  objective_arg(objective))
        assert got == want


@pytest.mark.parametrize("hw", [H100, CPU], ids=["h100", "cpu"])
def test_prediction_is_the_simulation(hw):
    """All-CP plans: the same number up to rounding; plans with local work: within a few
    percent (the cost model lets a rank's local linear work hide the first exchange)."""
    cp, bucket = 4, 8192
    cost = hw.cost_model(SMALL, cp, 2)
    for lengths in _batches(cp, bucket):
        for policy in ALL_CP + ("skrull", "hybrid-cp", "dynamic-cp"):
            plan = schedule(lengths, SchedulerConfig(dp_size=2, cp_size=cp, bucket_size=bucket,
                                                     policy=policy), cost)
            sim = simulate(plan, SMALL, hw)
            ratio = plan.predicted["iteration_time"] / sim.iteration_time
            if policy in ALL_CP:
                assert ratio == pytest.approx(1.0, rel=1e-9), policy
            else:
                assert 0.95 < ratio < 1.02, (policy, ratio)
            same = simulate(plan, SMALL, None, cost_model=cost)  # the cost model alone
            assert same.iteration_time == pytest.approx(sim.iteration_time, rel=1e-12)
