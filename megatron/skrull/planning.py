"""Builds the per-iteration planner: global-batch lengths -> :class:`skrull_ext.plan.Plan`.

Every rank calls the planner with the same lengths and gets the same plan (the scheduler
is deterministic), so no plan is ever broadcast.

TEMPORARY: until ``skrull_ext.scheduler`` is merged, :func:`make_planner` falls back to
:func:`greedy_plan`, a simple first-fit placement that only exists so the training stack
runs end to end (the integrator replaces the fallback branch with the real scheduler).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import numpy as np

from skrull_ext.plan import MicroBatch, Plan, shard_tokens

from megatron.skrull.arguments import RunConfig

logger = logging.getLogger(__name__)

Planner = Callable[[np.ndarray], Plan]


def make_planner(cfg: RunConfig) -> Planner:
    """The planner for this run (``--skrull-scheduler``, bucket, DP/CP sizes)."""
    dp, cp = cfg.parallel.dp_size, cfg.parallel.context_parallel_size
    bucket = cfg.skrull.bucket_size
    try:
        from skrull_ext.scheduler import schedule  # noqa: F401
    except ImportError:  # TEMPORARY until skrull_ext.scheduler is merged
        logger.warning("skrull_ext.scheduler not available: using the TEMPORARY greedy "
                       "planner instead of --skrull-scheduler %s", cfg.skrull.scheduler)
        return lambda lengths: greedy_plan(lengths, dp_size=dp, cp_size=cp, bucket_size=bucket)
    raise NotImplementedError(  # INTEGRATION: wire schedule(lengths, cfg, cost_model) here
        "skrull_ext.scheduler is present but megatron.skrull.planning.make_planner is not "
        "wired to it yet")


def predicted_seconds(plan: Plan) -> Optional[float]:
    """The scheduler's predicted iteration time in seconds, if it recorded one."""
    for key in ("iteration_time", "iteration_seconds", "critical_path", "time"):
        value = plan.predicted.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def greedy_plan(lengths: Sequence[int], *, dp_size: int, cp_size: int,
                bucket_size: int) -> Plan:
    """TEMPORARY first-fit planner (tests and development only).

    Samples go round-robin to DP ranks; within a DP rank, in order, each sample is put
    local on the least-loaded CP rank of the current micro-batch if it fits, else
    distributed if its shard fits on every rank, else a new micro-batch is opened.  DP
    ranks with fewer micro-batches are padded with empty ones.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    per_rank = []
    for d in range(dp_size):
        mbs: list[tuple[list[int], list[list[int]], list[int]]] = []
        for i in range(d, len(lengths), dp_size):
            if not mbs or not _place(mbs[-1], i, int(lengths[i]), cp_size, bucket_size):
                mbs.append(([], [[] for _ in range(cp_size)], [0] * cp_size))
                if not _place(mbs[-1], i, int(lengths[i]), cp_size, bucket_size):
                    raise ValueError(f"sample {i} of {lengths[i]} tokens does not fit "
                                     f"bucket {bucket_size} x CP {cp_size}")
        per_rank.append([MicroBatch(distributed=tuple(dist), local=tuple(map(tuple, loc)))
                         for dist, loc, _ in mbs])
    count = max(1, max(len(m) for m in per_rank))
    dp_ranks = tuple(tuple(m + [MicroBatch.empty(cp_size)] * (count - len(m)))
                     for m in per_rank)
    plan = Plan(lengths=lengths, dp_size=dp_size, cp_size=cp_size, bucket_size=bucket_size,
                policy="greedy-temporary", dp_ranks=dp_ranks)
    plan.validate()
    return plan


def _place(mb, sample: int, length: int, cp_size: int, bucket: int) -> bool:
    distributed, local, load = mb
    rank = int(np.argmin(load))
    if load[rank] + length <= bucket:
        local[rank].append(sample)
        load[rank] += length
        return True
    share = shard_tokens(length, cp_size)
    if cp_size > 1 and all(x + share <= bucket for x in load):
        distributed.append(sample)
        for r in range(cp_size):
            load[r] += share
        return True
    return False
