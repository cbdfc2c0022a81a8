"""(ours) Hybrid CP's plan, CP sub-group rings included, as Skrull's last candidate.

``schedule()`` asks :func:`candidate` after the portfolio: cheap gates first (a floor in
a few array ops, then a bound without building the plan), then the plan itself, built
and priced in the C++ core when it is there; only a winning plan becomes Python objects.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.model import CostModel
from skrull_ext.scheduler.baselines import BASELINES, hybrid_size_array
from skrull_ext.scheduler.config import SchedulerConfig
from skrull_ext.scheduler.plan import FlatPlan, MicroBatch, Plan
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.pricing import predict_arrays
from skrull_ext.sharding import padded_length_array, shard_tokens_array


def candidate(arr: np.ndarray, best: float, config: SchedulerConfig, cost_model: CostModel,
              arrays, backend: str = "python") -> Optional[Plan]:
    """Hybrid CP's own plan, CP sub-group rings included, when predicted faster than ``best``.

    Samples longer than the bucket can be sharded over a sub-group of 2, 4, .. < N ranks
    instead of all N (the DACP attention runs those rings, docs/attention.md): smaller rings
    run larger, more efficient blocks.  Built only when it can matter: CP >= 3, some
    sample fits such a sub-group, and ``best`` is above :func:`hybrid_bound`.  No size
    rule (unlike the portfolio's groupings): with ~1,000 micro-batches per DP rank
    (K = 65,536, bucket 2K, CP 8) hybrid CP's plan is 26% faster than Skrull's own.  Its
    micro-batches are re-dealt over the DP ranks where that is faster (:func:`dealt`).  Kept
    (policy ``skrull``, ``predicted["candidate"] = "hybrid-cp"``) only when predicted
    strictly faster.  The C++ backend builds and prices it in the core (:func:`_build_cpp`)
    and hands over only a winning plan; the Python build (:func:`_build_python`) is the
    spec, the same plan and float operations.

    Args:
        arr: ``[K]`` int64 lengths of the global batch (checked).
        best: Skrull's own plan's predicted iteration time (seconds).
        config: The :class:`~skrull_ext.scheduler.SchedulerConfig`.
        arrays: The batch's ``(costs, shares, comm)`` (as ``schedule`` computed them).
        backend: ``cpp`` or ``python`` (as ``schedule``'s).

    Returns:
        The validated, predicted plan, or ``None`` when Skrull's own plan stays.
    """
    n, c = config.cp_size, config.bucket_size
    if not config.subgroups or n < 3:
        return None
    cpp = _backend.CPP if backend == "cpp" else None
    floor = (hybrid_floor(arr, config, cost_model, arrays[0]) if cpp is None else
             cpp.hybrid_floor(arr, arrays[0], config.dp_size, n, c,
                              cost_model.micro_batch_overhead,
                              cost_model.time.iteration_overhead))
    if best <= floor:  # the cheapest gate first
        return None
    if not np.any((arr > c) & (shard_tokens_array(arr, subgroup_sizes(n)[-1]) <= c)):
        return None
    sub = subgroup_arrays(arr, n, c, cost_model)
    if best <= hybrid_bound(arr, config, cost_model, arrays, sub):
        return None
    build = _build_cpp if hasattr(cpp, "hybrid_candidate") else _build_python
    return winner(build(arr, config, cost_model, arrays, sub, best), best, "hybrid-cp")


def winner(built, best: float, name: str) -> Optional[Plan]:
    """A sub-group candidate's ``(plan, predicted)`` as Skrull's plan (``predicted
    ["candidate"] = name``, its flat arrays kept) when strictly faster than ``best``."""
    if built is None or built[1]["iteration_time"] >= best:
        return None
    cand, predicted = built
    out = dataclasses.replace(cand, predicted={**predicted, "candidate": name})
    out.__dict__["flat"] = cand.flat
    return out


def _build_python(arr, config: SchedulerConfig, cost_model: CostModel, arrays, sub, best):
    """The spec: hybrid CP's plan (``BASELINES["hybrid-cp"]``) as :class:`MicroBatch`
    objects, validated and predicted; ``(plan, predicted)``."""
    n, c = config.cp_size, config.bucket_size
    ranks = BASELINES["hybrid-cp"](arr, arrays[0], config.dp_size, n, c)
    m = max(1, max(len(r) for r in ranks))
    ranks = tuple(tuple(r) + (MicroBatch.empty(n),) * (m - len(r)) for r in ranks)
    cand = Plan(lengths=arr, dp_size=config.dp_size, cp_size=n, bucket_size=c,
                policy="skrull", dp_ranks=ranks)
    cand.validate()
    return redealt(cand, cost_model, arrays[0], arrays[2], arrays[1])


def dealt(times) -> Optional[list[list[int]]]:
    """(ours) Whole micro-batches re-dealt to the DP ranks, when that makes the slowest
    rank strictly faster; else ``None``.

    Megatron's dynamic CP balances each round's ``S^2 / g`` work across the DP replicas,
    not the ranks' totals over the rounds, so one rank can end 40% slower than another
    (user lengths, CP 16: 0.911 against 0.648 s); hybrid CP gives each rank a contiguous
    slice of the batch.  A micro-batch's time does not depend on its DP rank (its rings
    stay inside the replica), so the ranks may trade whole micro-batches; each keeps ``M``
    of them (empty ones included), as every plan has.  Longest processing time first:
    each micro-batch, the slowest first (ties: the lower index), goes to the least-loaded
    rank with fewer than ``M`` (ties: the lower rank).  The C++ core (``csrc/hybrid.cpp``) deals the same way.

    Args:
        times: ``[D][M]`` micro-batch seconds of the plan (``predict``'s).

    Returns:
        ``[D][M]`` indices ``d M + j`` into the flat (DP rank major) micro-batches, in the
        order each rank runs them, or ``None`` when the plan stays as it is.
    """
    d, m = len(times), len(times[0])
    flat = [t for row in times for t in row]
    load, deal = [0.0] * d, [[] for _ in range(d)]
    for g in sorted(range(d * m), key=lambda g: (-flat[g], g)):
        r = min((r for r in range(d) if len(deal[r]) < m), key=lambda r: (load[r], r))
        deal[r].append(g)
        load[r] += flat[g]  # the rank's left-to-right sum, as iteration_seconds adds
    return deal if max(load) < max(sum(row) for row in times) else None


def redealt(plan: Plan, cost_model: CostModel, costs, comm, shares) -> tuple[Plan, dict]:
    """``(plan, predicted)`` of a sub-group candidate's validated plan, its micro-batches
    re-dealt to the DP ranks (:func:`dealt`) where that makes it faster."""
    predicted = predict_arrays(plan, cost_model, costs, comm, shares)
    deal = dealt(predicted["micro_batch_times"])
    if deal is None:
        return plan, predicted
    mbs = [mb for rank in plan.dp_ranks for mb in rank]
    plan = dataclasses.replace(plan, dp_ranks=tuple(tuple(mbs[g] for g in r) for r in deal))
    plan.validate()
    return plan, predict_arrays(plan, cost_model, costs, comm, shares)


def _build_cpp(arr, config: SchedulerConfig, cost_model: CostModel, arrays, sub, best):
    """:func:`_build_python` in the C++ core (``_C.hybrid_candidate``: grouping, the
    sub-group pricing of :func:`~skrull_ext.scheduler.pricing.micro_batch_times`, bit for
    bit, and the placement check); ``None`` when it cannot beat ``best`` (nothing built in
    Python then)."""
    n = config.cp_size
    latency = np.zeros(n + 1)
    for g in subgroup_sizes(n):
        latency[g] = cost_model.comm_latency(g)
    _, got = _backend.CPP.hybrid_candidate(
        arr, arrays[0], arrays[1], arrays[2], sub[1], sub[2], latency,
        cost_model.comm_latency(n), config.dp_size, n, config.bucket_size,
        cost_model.micro_batch_overhead, cost_model.time.iteration_overhead,
        objective_arg(objective_of(cost_model)), best, micro_batch=MicroBatch)
    return core_candidate_plan(got, arr, config, cost_model, arrays)


def core_candidate_plan(got, arr, config: SchedulerConfig, cost_model: CostModel, arrays):
    """``(plan, predicted)`` of a sub-group candidate the C++ core built and priced
    (``_C.hybrid_candidate`` / ``_C.dyncp_candidate``'s winning plan: ``MicroBatch.trusted``
    objects, the flat arrays and the micro-batch times), or ``None`` when it did not win."""
    if got is None:
        return None
    ranks, (count, *flat_arrays, grouped, times, valid) = got
    cand = Plan(lengths=arr, dp_size=config.dp_size, cp_size=config.cp_size,
                bucket_size=config.bucket_size, policy="skrull",
                dp_ranks=tuple(map(tuple, ranks)))
    cand.__dict__["flat"] = FlatPlan(count, *flat_arrays, grouped, verified=valid)
    cand.validate()
    return cand, predict_arrays(cand, cost_model, arrays[0], arrays[2], arrays[1], times,
                                backend="cpp")


def subgroup_sizes(n: int) -> list[int]:
    """Hybrid CP's CP sub-group sizes at ``N = n`` ranks: the powers of two ``1 < g < N``
    (``[]`` below 3 ranks)."""
    return [1 << j for j in range(1, (n - 1).bit_length())]


def subgroup_arrays(arr, n: int, c: int, cost_model: CostModel):
    """``(sizes, share, comm)``, each ``[K]``: every sample's hybrid-CP group size and,
    where ``1 < size < N``, its per-rank seconds and ring bandwidth seconds on that
    sub-group (0 elsewhere), the cost model evaluated once per size."""
    sizes = hybrid_size_array(arr, n, c)
    share = np.zeros(arr.size, dtype=np.float64)
    comm = np.zeros(arr.size, dtype=np.float64)
    for g in subgroup_sizes(n):
        sel = np.flatnonzero(sizes == g)
        if sel.size:
            share[sel] = cost_model.share_seconds(arr[sel], g)
            comm[sel] = cost_model.comm_seconds(arr[sel], g)
    return sizes, share, comm


def hybrid_floor(arr, config: SchedulerConfig, cost_model: CostModel, costs) -> float:
    """:func:`hybrid_bound` with every sample's work and tokens at their unsharded values,
    which sharding only raises (``g x share_g >= cost``: the per-call overhead and the
    short-block surcharge grow, the FLOPs do not shrink; padding only adds tokens), so it
    is at most that bound, in a few array ops: the first, cheap gate (~15 us at K = 256
    against ~0.3 ms for the bound, which it settles there)."""
    n, c, d, k = config.cp_size, config.bucket_size, config.dp_size, arr.size
    if k < d:
        return 0.0
    starts = [(k // d) * j + min(j, k % d) for j in range(d)]  # numpy.array_split's slices
    work = np.add.reduceat(costs, starts)
    mbs = np.maximum(1, -(-np.add.reduceat(arr, starts) // (c * n)))
    worst = float((work / n + cost_model.micro_batch_overhead * mbs).max())
    return (worst + cost_model.time.iteration_overhead) * (1.0 - 1e-12)


def hybrid_bound(arr, config: SchedulerConfig, cost_model: CostModel, arrays,
                  sub=None) -> float:
    """A lower bound on hybrid CP's predicted iteration time, without building its plan.

    Hybrid CP gives DP rank ``d`` the ``d``-th contiguous slice of the batch and sample
    ``i`` a block of ``n_i`` ranks (``baselines.hybrid_cp_size``).  A micro-batch's time is
    at least the mean over its CP ranks of local plus sharded work, plus the overhead
    (``rank_time(x, comm, dist) >= x + dist`` under both objectives, see
    :mod:`~skrull_ext.scheduler.bound`), and a DP rank needs at least ``ceil(tokens /
    (C N))`` micro-batches; so the slowest slice's ``work / N + overhead x micro-batches``.
    It bounds hybrid CP's own deal of micro-batches to DP ranks; the candidate's re-deal
    (:func:`dealt`) may beat it, and is then not tried: a choice for latency (the mean over
    the slices, which bounds the re-deal, lets the candidate be built at K = 256 and
    doubles ``schedule()``'s 0.2 ms there).
    ``sub``: :func:`subgroup_arrays` of the batch, when already computed.
    """
    n, c, d = config.cp_size, config.bucket_size, config.dp_size
    sizes, share, _ = sub if sub is not None else subgroup_arrays(arr, n, c, cost_model)
    work = np.where(sizes == 1, arrays[0], np.where(sizes == n, n * arrays[1], sizes * share))
    tokens = padded_length_array(arr, sizes)  # over g ranks: pad(S, g) tokens in all
    k, worst = arr.size, 0.0
    for j in range(min(d, k)):  # numpy.array_split's slices (empty ones add nothing)
        lo, hi = (k // d) * j + min(j, k % d), (k // d) * (j + 1) + min(j + 1, k % d)
        mbs = max(1, -(-int(tokens[lo:hi].sum()) // (c * n)))
        worst = max(worst, float(work[lo:hi].sum()) / n + cost_model.micro_batch_overhead * mbs)
    return (worst + cost_model.time.iteration_overhead) * (1.0 - 1e-12)


__all__ = ["candidate", "core_candidate_plan", "dealt", "hybrid_bound", "hybrid_floor", "redealt",
           "subgroup_arrays", "subgroup_sizes", "winner"]
