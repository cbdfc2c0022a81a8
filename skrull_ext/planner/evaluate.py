"""Schedules sampled global batches with every policy and simulates them.

Shared by the planner CLI (:mod:`skrull_ext.planner.cli`) and ``benchmarks/paper_table.py``.
Each policy schedules with the scheduler's simple cost model derived from the same
hardware preset (:meth:`Hardware.cost_model`), and every plan is then timed by the
detailed simulator, so all policies are judged by one yardstick they were not tuned on.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from skrull_ext.costmodel.model import ModelSpec
from skrull_ext.costmodel.hardware import Hardware
from skrull_ext.scheduler.plan import Plan
from skrull_ext.scheduler import POLICIES, SchedulerConfig, schedule
from skrull_ext.planner.pipeline import simulate_pipeline
from skrull_ext.sharding import shard_tokens_array
from skrull_ext.planner.simulator import SimResult, simulate


@dataclasses.dataclass(frozen=True)
class PolicyStats:
    """One policy over ``B`` global batches (``[B]`` arrays).

    Attributes:
        policy: Policy name.
        iteration_times: Simulated seconds per batch.
        lower_bounds: The simulator's lower bound per batch (same for every policy).
        micro_batches: Micro-batches per DP rank per batch.
        local_shares: Share of tokens kept local per batch.
        padding_shares: Share of held tokens that are zigzag padding per batch.
    """

    policy: str
    iteration_times: np.ndarray
    lower_bounds: np.ndarray
    micro_batches: np.ndarray
    local_shares: np.ndarray
    padding_shares: np.ndarray

    @property
    def mean_time(self) -> float:
        return float(self.iteration_times.mean())

    @property
    def ratio_to_bound(self) -> float:
        """Mean iteration time over the mean lower bound (>= 1)."""
        return self.mean_time / float(self.lower_bounds.mean())


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every policy on the same batches, plus batch 0's plans and simulations."""

    stats: dict
    example_plans: dict
    example_results: dict

    def speedup(self, policy: str, of: str = "skrull") -> float:
        """Mean iteration time of ``policy`` over that of ``of`` (ratio of means)."""
        return self.stats[policy].mean_time / self.stats[of].mean_time

    def speedup_per_batch(self, policy: str, of: str = "skrull") -> np.ndarray:
        """``[B]`` per-batch ratios ``t_policy / t_of``."""
        return self.stats[policy].iteration_times / self.stats[of].iteration_times


def _stats(policy: str, plans: Sequence[Plan], results: Sequence[SimResult],
           pipelined: Optional[Sequence] = None) -> PolicyStats:
    timed = results if pipelined is None else pipelined
    return PolicyStats(
        policy=policy,
        iteration_times=np.array([r.iteration_time for r in timed]),
        lower_bounds=np.array([r.lower_bound for r in timed]),
        micro_batches=np.array([p.num_micro_batches for p in plans]),
        local_shares=np.array([p.local_token_share() for p in plans]),
        padding_shares=np.array([r.summary()["padding_share"] for r in results]),
    )


def compare_policies(batches: Sequence[np.ndarray], model: ModelSpec, hardware: Hardware, *,
                     dp_size: int, cp_size: int, bucket_size: int,
                     policies: Sequence[str] = POLICIES, backend: Optional[str] = None,
                     objective: str = "ring", pp_size: int = 1,
                     pp_order: str = "best", plan_budget_ms: Optional[float] = None
                     ) -> Comparison:
    """Schedules and simulates every batch with every policy.

    Args:
        batches: Global batches, each ``[K]`` lengths (all must fit: see
            :func:`skrull_ext.scheduler.check_lengths`).
        model: Model shape.
        hardware: Simulator preset (also the source of the schedulers' cost model).
        dp_size, cp_size, bucket_size: Parallel layout and token bucket.
        policies: Policies to run.
        backend: Skrull scheduler backend (``cpp``/``python``; default the build's).
        objective: The schedulers' :attr:`~skrull_ext.costmodel.model.CostModel.objective`.
        pp_size: Pipeline stages; above 1 the iteration times are the 1F1B pipeline's
            (:func:`~skrull_ext.planner.pipeline.simulate_pipeline`, micro-batches fed in
            ``pp_order``) and so are the lower bounds; the rest of the stats are the
            whole-model simulation's.
        pp_order: Feed order of the pipeline (``best`` tries every order).
        plan_budget_ms: Skrull's refinement budget (default: SchedulerConfig's).

    Returns:
        :class:`Comparison`.
    """
    cost = dataclasses.replace(hardware.cost_model(model, cp_size), objective=objective)
    stats, plans0, results0 = {}, {}, {}
    for policy in policies:
        cfg = SchedulerConfig(dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                              policy=policy)
        if plan_budget_ms is not None:
            cfg = dataclasses.replace(cfg, plan_budget_ms=plan_budget_ms)
        plans = [schedule(b, cfg, cost, backend=backend) for b in batches]
        results = [simulate(p, model, hardware) for p in plans]
        piped = None
        if pp_size > 1:
            piped = [simulate_pipeline(p, model, hardware, pp_size=pp_size, order=pp_order)
                     for p in plans]
        stats[policy] = _stats(policy, plans, results, piped)
        plans0[policy], results0[policy] = plans[0], results[0]
    return Comparison(stats=stats, example_plans=plans0, example_results=results0)


def fastest_bucket(batches: Sequence[np.ndarray], model: ModelSpec, hardware: Hardware, *,
                   dp_size: int, cp_size: int, max_bucket: int, objective: str = "ring",
                   backend: Optional[str] = None,
                   fractions: Sequence[float] = (1.0, 0.75, 0.5, 0.25)) -> tuple[int, dict]:
    """The bucket with the lowest mean predicted Skrull iteration time, within memory.

    Tries ``fractions`` of ``max_bucket`` (the memory model's largest bucket) that still
    hold every sampled sequence distributed; ties keep the larger bucket.  A smaller bucket
    can win: fewer tokens per micro-batch change how GDS interleaves and how DACP places.

    Returns:
        ``(bucket, {bucket: mean predicted seconds})`` (the scheduler's cost model).
    """
    cost = dataclasses.replace(hardware.cost_model(model, cp_size, dp_size), objective=objective)
    need = max(int(shard_tokens_array(b, cp_size).max()) for b in batches)
    times = {}
    for frac in fractions:
        bucket = int(max_bucket * frac)
        if bucket < max(need, 2 * cp_size if cp_size > 1 else 1) or bucket in times:
            continue
        cfg = SchedulerConfig(dp_size=dp_size, cp_size=cp_size, bucket_size=bucket)
        times[bucket] = float(np.mean([schedule(b, cfg, cost, backend=backend)
                                       .predicted["iteration_time"] for b in batches]))
    best = min(times, key=lambda c: (times[c], -c))
    return best, times


__all__ = ["Comparison", "PolicyStats", "compare_policies", "fastest_bucket"]


def max_fitting_length(cp_size: int, bucket_size: int) -> int:
    """Longest sequence whose zigzag shard fits the bucket: ``shard_tokens(S, N) <= C``.

    ``shard = 2 ceil(S / 2N)`` for ``N > 1``, so ``S <= 2 N floor(C / 2)``; ``S <= C`` when
    ``N == 1``.
    """
    if cp_size <= 1:
        return int(bucket_size)
    return 2 * cp_size * (int(bucket_size) // 2)


__all__.append("max_fitting_length")
