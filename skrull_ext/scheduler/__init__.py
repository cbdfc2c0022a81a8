"""Scheduling a global batch: Skrull (DACP + GDS) and the baselines, one entry point.

>>> from skrull_ext.scheduler import SchedulerConfig, schedule
>>> plan = schedule([900, 120, 30000, 64], SchedulerConfig(dp_size=2, cp_size=4,
...                                                      bucket_size=8192))
>>> plan.num_micro_batches
1

The Skrull policy runs on the backend chosen by ``SKRULL_IMPL`` (``skrull_ext.BACKEND``);
the baselines are Python only.  Every returned plan has passed :meth:`Plan.validate`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.model import CostModel, default_cost_model
from skrull_ext.scheduler.plan import FlatPlan, MicroBatch, Plan
from skrull_ext.sharding import padded_length, shard_tokens
from skrull_ext.scheduler import dyncp, groupfill, hybrid, portfolio, reference
from skrull_ext.scheduler.baselines import BASELINES
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.pricing import (iteration_seconds, micro_batch_seconds, predict,
                                          predict_arrays, split_times)
from skrull_ext.scheduler.config import (DEFAULT_POLICIES, POLICIES, ScheduleInputError,
                                         SchedulerConfig, _ROLLBACK_CODES, _VARIANT_CODES)
from skrull_ext.scheduler.refine import budget_work


def check_lengths(lengths: Sequence[int], cp_size: int, bucket_size: int) -> np.ndarray:
    """Validates a global batch's lengths; returns them as ``[K]`` int64.

    Raises:
        ScheduleInputError: empty batch, a non-integer, a length < 1, or a sample that can
            never fit (``pad(S)/N > bucket``), naming the first offending index.
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ScheduleInputError("the global batch is empty: give at least one sample length")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            bad = next(i for i, x in enumerate(arr.tolist())
                       if not (isinstance(x, (int, float)) and float(x).is_integer()))
            raise ScheduleInputError(f"sample {bad} has non-integer length {arr.tolist()[bad]!r}")
    arr = arr.astype(np.int64)
    if arr.min() < 1:
        i = int(np.flatnonzero(arr < 1)[0])
        raise ScheduleInputError(
            f"sample {i} has length {int(arr[i])} (< 1): remove zero-length samples from the data")
    limit = bucket_size * cp_size
    if arr.max() <= limit - 2 * cp_size + 1:  # every sample fits distributed (the usual case)
        return arr
    for i in np.flatnonzero(arr > limit - 2 * cp_size + 1).tolist():
        if shard_tokens(int(arr[i]), cp_size) > bucket_size:
            s = int(arr[i])
            raise ScheduleInputError(
                f"sample {i} of length {s} cannot fit even when distributed: it needs "
                f"{shard_tokens(s, cp_size)} tokens per CP rank (padded {padded_length(s, cp_size)}"
                f" / cp_size {cp_size}) > bucket size {bucket_size}; raise the bucket size "
                f"(--skrull-bucket-size / --bucket-size) to >= {shard_tokens(s, cp_size)}, raise "
                "--context-parallel-size, or truncate long samples")
    return arr


def _to_micro_batch(placement, cp_size: int) -> MicroBatch:
    """``(distributed, local)`` lists -> :class:`MicroBatch`."""
    dist, local = placement
    return MicroBatch(distributed=tuple(map(int, dist)),
                      local=tuple(tuple(map(int, r)) for r in local))


def _skrull(lengths, costs, shares, comm, latency, cfg: SchedulerConfig, overhead: float,
            backend: str, objective: str):
    """The Skrull policy's placements; the C++ backend returns ``(placements, flat)`` with
    ``flat = (count, dist_ids, dist_mb, local_ids, local_slot)`` (:class:`FlatPlan`)."""
    args = (lengths, costs, comm)
    work = budget_work(cfg.plan_budget_ms, len(lengths))
    if backend == "cpp":
        cpp = _backend.CPP
        args += (float(latency), cfg.dp_size, cfg.cp_size, cfg.bucket_size,
                 _ROLLBACK_CODES[cfg.rollback], float(overhead), _VARIANT_CODES[cfg.dacp], shares)
        if cfg.portfolio:
            return cpp.portfolio_schedule(*args, objective=objective_arg(objective),
                                          budget=work, flat=True)
        return cpp.gds_schedule(*args, objective=objective_arg(objective), flat=True)
    args += (latency, cfg.dp_size, cfg.cp_size, cfg.bucket_size, cfg.rollback, overhead,
             cfg.dacp, shares, objective)
    if cfg.portfolio:
        return portfolio.portfolio_schedule(*args, budget=work)
    return reference.gds_schedule(*args)


def schedule(lengths: Sequence[int], config: SchedulerConfig,
             cost_model: Optional[CostModel] = None, *, backend: Optional[str] = None) -> Plan:
    """Schedules one global batch.

    Args:
        lengths: ``[K]`` token lengths of the global batch (sample ``i`` is index ``i``).
        config: Parallel sizes, bucket and policy.
        cost_model: Compute/communication costs; defaults to Qwen2.5-0.5B on H100.
        backend: ``cpp`` or ``python`` for the Skrull policy; default ``skrull_ext.BACKEND``.

    Returns:
        A validated :class:`Plan` with ``predicted`` filled in.

    Raises:
        ScheduleInputError: bad lengths or config (the message names the fix).
    """
    cost_model = cost_model or default_cost_model()
    arr = check_lengths(lengths, config.cp_size, config.bucket_size)
    backend = backend or _backend.BACKEND
    if backend == "cpp" and _backend.CPP is None:
        raise ImportError("backend='cpp' but skrull_ext._C is not built")
    costs, comm, shares = cost_model.schedule_arrays(arr, config.cp_size, backend=backend)
    arrays = (costs, shares, comm)
    if config.policy != "skrull":
        policy = BASELINES[config.policy]
        extra = {"cost_model": cost_model} if getattr(policy, "wants_cost_model", False) else {}
        ranks = policy(arr, costs, config.dp_size, config.cp_size, config.bucket_size, **extra)
        return _finish(arr, config, ranks, cost_model, arrays, backend)
    placements = _skrull(arr, costs, shares, comm, cost_model.comm_latency(config.cp_size),
                         config, cost_model.micro_batch_overhead, backend,
                         objective_of(cost_model))
    if backend != "cpp":
        ranks = [[_to_micro_batch(p, config.cp_size) for p in mbs] for mbs in placements]
        return _or_hybrid(_finish(arr, config, ranks, cost_model, arrays, backend), config,
                          cost_model, arrays, backend)
    # The core's tuples, and flat arrays sparing validate() a walk per sample.
    placements, (count, *flat_arrays, times, bound, valid) = placements
    counts = [len(mbs) for mbs in placements]
    gated = min(counts, default=0) > 0 and len(set(counts)) == 1
    if gated:
        # Hybrid CP's gate on the core's micro-batch times, before Skrull's plan objects:
        # where it wins (K = 65,536, bucket 2K: ~4,000 micro-batches) they are never built
        # (~6 ms with their release).  The same floats as the built plan's prediction.
        best = iteration_seconds(split_times(times, counts), cost_model)[1]
        won = _best_candidate(arr, best, config, cost_model, arrays, backend)
        if won is not None:
            return won
    trusted = MicroBatch.trusted
    ranks = [tuple([trusted(*p) for p in mbs]) for mbs in placements]
    plan = _finish(arr, config, ranks, cost_model, arrays, backend,
                   FlatPlan(count, *flat_arrays, [], verified=valid), times, bound)
    return plan if gated else _or_hybrid(plan, config, cost_model, arrays, backend)


def _finish(arr, config: SchedulerConfig, ranks, cost_model: CostModel, arrays, backend: str,
            flat: Optional[FlatPlan] = None, times=None, bound=None) -> Plan:
    """The validated, predicted :class:`Plan` of per-DP-rank micro-batch lists (padded
    to equal counts with empty micro-batches); ``flat``, ``times``, ``bound``: the C++
    core's (see :func:`~skrull_ext.scheduler.pricing.predict_arrays`)."""
    counts = {len(r) for r in ranks}
    if len(counts) > 1 or 0 in counts:
        m = max(1, max(counts))
        flat = times = None  # padding renumbers the micro-batches
        ranks = [list(r) + [MicroBatch.empty(config.cp_size)] * (m - len(r)) for r in ranks]
    plan = Plan(lengths=arr, dp_size=config.dp_size, cp_size=config.cp_size,
                bucket_size=config.bucket_size, policy=config.policy,
                dp_ranks=tuple(map(tuple, ranks)))
    if flat is not None:
        plan.__dict__["flat"] = flat  # Plan.flat's cached_property slot
    plan.validate()
    costs, shares, comm = arrays
    # Filled in place: the plan is new and unshared (a replace() would drop Plan.flat).
    plan.predicted.update(predict_arrays(plan, cost_model, costs, comm, shares, times, bound,
                                         backend=backend))
    return plan


# The candidates asked after Skrull's own plan, in this order (modules, so a test can
# switch one off by patching its ``candidate``): hybrid CP, Megatron's dynamic CP, the
# group-fill greedy.
CANDIDATES = (hybrid, dyncp, groupfill)


def _best_candidate(arr: np.ndarray, best: float, config: SchedulerConfig,
                    cost_model: CostModel, arrays, backend: str) -> Optional[Plan]:
    """The last of :data:`CANDIDATES`' plans that was strictly faster than the best so far
    (``best``: Skrull's plan's predicted seconds, then each winner's), or ``None``."""
    won = None
    for module in CANDIDATES:
        got = module.candidate(arr, best, config, cost_model, arrays, backend)
        if got is not None:
            won, best = got, got.predicted["iteration_time"]
    return won


def _or_hybrid(plan: Plan, config: SchedulerConfig, cost_model: CostModel, arrays,
               backend: str) -> Plan:
    """Skrull's ``plan``, or the fastest candidate's when predicted faster
    (:func:`_best_candidate`)."""
    won = _best_candidate(plan.lengths, plan.predicted["iteration_time"], config, cost_model,
                          arrays, backend)
    return plan if won is None else won

__all__ = ["DEFAULT_POLICIES", "POLICIES", "SchedulerConfig", "ScheduleInputError", "check_lengths",
           "micro_batch_seconds", "predict", "schedule"]
