"""(ours) Megatron's dynamic-CP plan, CP sub-group rings included, as Skrull's candidate.

Megatron-LM's ``DefaultDynamicCPScheduler`` (:func:`~skrull_ext.scheduler.megatron_packing.
dynamic_cp`) builds every micro-batch over all ``D x N`` ranks at once: each sample gets
the smallest power-of-two CP group its length needs, and the groups are balanced by their
``S^2 / g`` work across DP replicas.  Where many samples are somewhat longer than the
bucket (ChatQA2-like lengths, CP 16) that beats both Skrull's own plans, which shard such
a sample over all ``N`` ranks, and hybrid CP's, which keeps contiguous DP slices.
``schedule()`` asks :func:`candidate` after the hybrid-CP candidate: a floor in a few array
ops first (the common case stops there), then the plan itself, priced by the same
:func:`~skrull_ext.scheduler.pricing.predict_arrays` as every plan, kept only when
strictly faster.  So Skrull's predicted time is never above the ``dynamic-cp`` baseline's
on the same cost model, up to :data:`MAX_DYNCP_SAMPLES` samples.

The Python build (:func:`_build_python`: the baseline's own code, then ``predict_arrays``
and the re-deal of :func:`~skrull_ext.scheduler.hybrid.dealt`)
is the spec; the C++ backend builds and prices the same plan in the core
(``csrc/dyncp.cpp``, :func:`_build_cpp`) and hands over only a winning plan.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.model import CostModel
from skrull_ext.scheduler.baselines import BASELINES
from skrull_ext.scheduler.config import SchedulerConfig
from skrull_ext.scheduler.hybrid import core_candidate_plan, redealt, subgroup_sizes, winner
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.plan import MicroBatch, Plan

# Above this many samples the candidate is skipped (a size rule, so the plan is the same
# on every run): Megatron's grouping scans the remaining samples every micro-batch; the C++
# core's galloping scan builds it in ~16 ms at K = 16,384 and ~80 ms at K = 65,536 (DP 4 x
# CP 8, 2-core VM), too much beside schedule()'s ~50 ms there.  At GBS 8192 the candidate
# matters: without it Skrull was behind dynamic CP in 14 of 48 settings (paper, 0.966x).
MAX_DYNCP_SAMPLES = 1 << 14


def candidate(arr: np.ndarray, best: float, config: SchedulerConfig, cost_model: CostModel,
              arrays, backend: str = "python") -> Optional[Plan]:
    """Megatron's dynamic-CP plan when predicted strictly faster than ``best``.

    Args:
        arr: ``[K]`` int64 lengths of the global batch (checked).
        best: The best plan's predicted iteration time so far (seconds).
        config: The :class:`~skrull_ext.scheduler.SchedulerConfig`.
        arrays: The batch's ``(costs, shares, comm)`` (as ``schedule`` computed them).
        backend: ``cpp`` or ``python`` (as ``schedule``'s).

    Returns:
        The validated, predicted plan (policy ``skrull``, ``predicted["candidate"] =
        "dynamic-cp"``), or ``None`` when the best plan so far stays.
    """
    n = config.cp_size
    if (n < 2 or arr.size > MAX_DYNCP_SAMPLES or (n >= 3 and not config.subgroups)
            or best <= dyncp_floor(arr, config, cost_model, arrays[0])):
        return None
    cpp = _backend.CPP if backend == "cpp" else None
    build = _build_cpp if hasattr(cpp, "dyncp_candidate") else _build_python
    return winner(build(arr, config, cost_model, arrays, best), best, "dynamic-cp")


def _build_python(arr, config: SchedulerConfig, cost_model: CostModel, arrays, best):
    """The spec: the ``dynamic-cp`` baseline's plan as :class:`MicroBatch` objects,
    validated and predicted; ``(plan, predicted)``."""
    n = config.cp_size
    costs, shares, comm = arrays
    ranks = BASELINES["dynamic-cp"](arr, costs, config.dp_size, n, config.bucket_size)
    m = max(1, max(len(r) for r in ranks))
    ranks = tuple(tuple(r) + (MicroBatch.empty(n),) * (m - len(r)) for r in ranks)
    plan = Plan(lengths=arr, dp_size=config.dp_size, cp_size=n, bucket_size=config.bucket_size,
                policy="skrull", dp_ranks=ranks)
    plan.validate()
    return redealt(plan, cost_model, costs, comm, shares)


def _build_cpp(arr, config: SchedulerConfig, cost_model: CostModel, arrays, best):
    """:func:`_build_python` in the C++ core (``_C.dyncp_candidate``: Megatron's grouping
    decision for decision, the sub-group pricing of
    :func:`~skrull_ext.scheduler.pricing.micro_batch_times` bit for bit, and the placement
    check); ``None`` when it cannot beat ``best`` (nothing built in Python then).  The
    sub-group seconds of every sample at every size ``2, 4, .. < N`` go in as rows: the
    group sizes are known only once the plan is built."""
    n = config.cp_size
    sizes = subgroup_sizes(n)
    share = np.empty((len(sizes), arr.size))
    comm = np.empty((len(sizes), arr.size))
    latency = np.zeros(n + 1)
    cpp = _backend.CPP
    for row, g in enumerate(sizes):  # _C.cost_arrays: share_seconds / comm_seconds, bitwise
        _, comm[row], share[row] = cpp.cost_arrays(arr, g, cost_model.cost_scalars,
                                                   cost_model.shard_token_seconds(g))
        latency[g] = cost_model.comm_latency(g)
    _, got = cpp.dyncp_candidate(
        arr, arrays[0], arrays[1], arrays[2], share, comm, latency,
        cost_model.comm_latency(n), config.dp_size, n, config.bucket_size,
        cost_model.micro_batch_overhead, cost_model.time.iteration_overhead,
        objective_arg(objective_of(cost_model)), best, micro_batch=MicroBatch)
    return core_candidate_plan(got, arr, config, cost_model, arrays)


def dyncp_floor(arr, config: SchedulerConfig, cost_model: CostModel, costs) -> float:
    """A lower bound on any plan's predicted iteration time whose DP ranks' micro-batches
    are filled up to the bucket, sub-group rings included, in a few array ops.

    Every CP rank's time in a micro-batch is at least its local work plus its share of each
    sharded sample's (``rank_time(x, comm, dist) >= x + dist`` under both objectives, see
    :mod:`~skrull_ext.scheduler.bound`), and sharding over ``g`` ranks only raises the work
    (``g x share_g >= cost``, see :func:`~skrull_ext.scheduler.hybrid.hybrid_floor`), so a
    micro-batch costs at least its samples' ``cost / N`` plus the overhead; the non-empty
    micro-batches of all DP ranks hold at least ``ceil(sum S / (C N))`` of them, and the
    slowest DP rank at least their mean over the ``D`` ranks.
    """
    n, c, d = config.cp_size, config.bucket_size, config.dp_size
    mbs = -(-int(arr.sum()) // (c * n))
    worst = (float(costs.sum()) / n + cost_model.micro_batch_overhead * mbs) / d
    return (worst + cost_model.time.iteration_overhead) * (1.0 - 1e-12)


__all__ = ["MAX_DYNCP_SAMPLES", "candidate", "dyncp_floor"]
