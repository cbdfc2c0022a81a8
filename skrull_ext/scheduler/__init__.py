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

import dataclasses
from typing import Optional, Sequence

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.model import CostModel, default_cost_model
from skrull_ext.scheduler.plan import FlatPlan, MicroBatch, Plan
from skrull_ext.sharding import (padded_length, padded_length_array, shard_tokens,
                                 shard_tokens_array)
from skrull_ext.scheduler import portfolio, reference
from skrull_ext.scheduler.baselines import BASELINES, hybrid_size_array
from skrull_ext.scheduler.bound import finish_bound, lower_bound
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS, budget_work

POLICIES = ("skrull",) + tuple(BASELINES)
_ROLLBACK_CODES = {"shortest": 0, "best-fit": 1, "auto": 2}
_VARIANT_CODES = {"paper": 0, "balanced": 1, "lpt": 2, "auto": 3}
_OBJECTIVE_CODES = {"paper": 0, "ring": 1}


class ScheduleInputError(ValueError):
    """The global batch cannot be scheduled as given; the message names the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How to schedule.

    Attributes:
        dp_size: Data-parallel degree ``D`` (>= 1).
        cp_size: Context-parallel degree ``N`` (>= 1).
        bucket_size: Most tokens per CP rank per micro-batch (``--skrull-bucket-size``).
        policy: ``skrull`` or a baseline name (see ``POLICIES``).
        rollback: DACP roll-back victim choice: ``shortest`` (the paper), ``best-fit``
            (ours) or ``auto`` (both, keep the faster micro-batch).
        dacp: DACP step a: ``paper`` (keep every sequence that fits local), ``balanced``
            (ours: distribute when that lowers the micro-batch objective), ``lpt`` (ours:
            distribute the ``k`` longest, pack the rest by LPT, best ``k``) or ``auto``
            (all three, keep the fastest micro-batch).
        portfolio: (ours) Also place the baselines' groupings with DACP and keep the
            fastest plan (:mod:`skrull_ext.scheduler.portfolio`); ``False`` runs GDS alone.
        plan_budget_ms: (ours) Local-search refinement budget of the portfolio's plan
            (``--skrull-plan-budget-ms``; :mod:`skrull_ext.scheduler.refine`), converted to
            a deterministic work count (the same plan on every rank); 0 disables it.
        subgroups: (ours) Let Skrull keep hybrid CP's plan, CP sub-group rings included,
            when predicted faster (:func:`_hybrid_candidate`); off where the attention
            cannot run sub-group rings (Transformer Engine without flash-attn).
    """

    dp_size: int
    cp_size: int
    bucket_size: int
    policy: str = "skrull"
    rollback: str = "auto"
    dacp: str = "auto"
    portfolio: bool = True
    plan_budget_ms: float = DEFAULT_BUDGET_MS
    subgroups: bool = True

    def __post_init__(self):
        for name, flag in (("dp_size", "--dp-size"), ("cp_size", "--cp-size / --context-parallel-size"),
                           ("bucket_size", "--bucket-size / --skrull-bucket-size")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ScheduleInputError(f"{name} must be an integer >= 1, got {value!r}: fix {flag}")
        if self.policy not in POLICIES:
            raise ScheduleInputError(f"unknown policy {self.policy!r}: choose one of {POLICIES}")
        if self.rollback not in _ROLLBACK_CODES:
            raise ScheduleInputError(
                f"unknown rollback {self.rollback!r}: choose one of {tuple(_ROLLBACK_CODES)}")
        if self.dacp not in _VARIANT_CODES:
            raise ScheduleInputError(
                f"unknown dacp variant {self.dacp!r}: choose one of {tuple(_VARIANT_CODES)}")
        budget = self.plan_budget_ms
        if (isinstance(budget, bool) or not isinstance(budget, (int, float, np.number))
                or not 0 <= budget < 1e6):
            raise ScheduleInputError(
                f"plan budget must be a number of ms in [0, 1e6), got {budget!r}: fix "
                "--skrull-plan-budget-ms")
        if self.bucket_size < 2 * self.cp_size and self.cp_size > 1:
            raise ScheduleInputError(
                f"bucket size {self.bucket_size} is smaller than one padded token pair per rank "
                f"(2 x cp_size = {2 * self.cp_size}); raise --skrull-bucket-size")


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
    work = budget_work(cfg.plan_budget_ms)
    if backend == "cpp":
        cpp = _backend.CPP
        args += (float(latency), cfg.dp_size, cfg.cp_size, cfg.bucket_size,
                 _ROLLBACK_CODES[cfg.rollback], float(overhead), _VARIANT_CODES[cfg.dacp], shares)
        if cfg.portfolio:
            return cpp.portfolio_schedule(*args, objective=_OBJECTIVE_CODES[objective],
                                          budget=work, flat=True)
        return cpp.gds_schedule(*args, objective=_OBJECTIVE_CODES[objective], flat=True)
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
    flat = times = bound = None
    if config.policy == "skrull":
        placements = _skrull(arr, costs, shares, comm, cost_model.comm_latency(config.cp_size),
                             config, cost_model.micro_batch_overhead, backend,
                             cost_model.objective)
        if backend == "cpp":  # tuples, and flat arrays sparing validate() a walk per sample
            placements, (count, *arrays, times, bound, valid) = placements
            flat = FlatPlan(count, *arrays, [], verified=valid)
            trusted = MicroBatch.trusted
            ranks = [tuple([trusted(*p) for p in mbs]) for mbs in placements]
        else:
            ranks = [[_to_micro_batch(p, config.cp_size) for p in mbs] for mbs in placements]
    else:
        ranks = BASELINES[config.policy](arr, costs, config.dp_size, config.cp_size,
                                         config.bucket_size)
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
    # Filled in place: the plan is new and unshared (a replace() would drop Plan.flat).
    plan.predicted.update(_predict(plan, cost_model, costs, comm, shares, times, bound))
    if config.policy == "skrull":
        plan = _hybrid_candidate(plan, config, cost_model, (costs, shares, comm), backend)
    return plan


def _hybrid_candidate(plan: Plan, config: SchedulerConfig, cost_model: CostModel,
                      arrays, backend: str = "python") -> Plan:
    """(ours) Hybrid CP's own plan, CP sub-group rings included, as a last candidate.

    Samples longer than the bucket can be sharded over a sub-group of 2, 4, .. < N ranks
    instead of all N (the DACP attention runs those rings, docs/attention.md): smaller rings
    run larger, more efficient blocks.  Built only when it can matter: CP >= 3, some
    sample fits such a sub-group, and Skrull's prediction is above
    :func:`_hybrid_bound`.  No size rule (unlike the portfolio's groupings): with ~1,000
    micro-batches per DP rank (K = 65,536, bucket 2K, CP 8) hybrid CP's plan is 26% faster
    than Skrull's own.  Kept (policy still ``skrull``, ``predicted["candidate"] =
    "hybrid-cp"``) only when predicted strictly faster.  The C++ backend builds and
    prices it in the core (:func:`_hybrid_cpp`) and hands over only a winning plan; the
    Python build (:func:`_hybrid_python`) is the spec, the same plan and float operations.

    Args:
        plan: Skrull's validated, predicted plan.
        arrays: The batch's ``(costs, shares, comm)`` (as ``schedule`` computed them).
        backend: ``cpp`` or ``python`` (as :func:`schedule`'s).
    """
    arr, n, c = plan.lengths, config.cp_size, config.bucket_size
    if not config.subgroups or n < 3:
        return plan
    best = plan.predicted["iteration_time"]
    cpp = _backend.CPP if backend == "cpp" else None
    floor = (_hybrid_floor(arr, config, cost_model, arrays[0]) if cpp is None else
             cpp.hybrid_floor(arr, arrays[0], config.dp_size, n, c,
                              cost_model.micro_batch_overhead,
                              cost_model.time.iteration_overhead))
    if best <= floor:  # the cheapest gate first
        return plan
    if not np.any((arr > c) & (shard_tokens_array(arr, _subgroup_sizes(n)[-1]) <= c)):
        return plan
    sub = _subgroup_arrays(arr, n, c, cost_model)
    if best <= _hybrid_bound(arr, config, cost_model, arrays, sub):
        return plan
    build = _hybrid_cpp if hasattr(cpp, "hybrid_candidate") else _hybrid_python
    built = build(arr, config, cost_model, arrays, sub, best)
    if built is None or built[1]["iteration_time"] >= best:
        return plan
    cand, predicted = built
    out = dataclasses.replace(cand, predicted={**predicted, "candidate": "hybrid-cp"})
    out.__dict__["flat"] = cand.flat
    return out


def _hybrid_python(arr, config: SchedulerConfig, cost_model: CostModel, arrays, sub, best):
    """The spec: hybrid CP's plan (``BASELINES["hybrid-cp"]``) as :class:`MicroBatch`
    objects, validated and predicted; ``(plan, predicted)``."""
    n, c = config.cp_size, config.bucket_size
    ranks = BASELINES["hybrid-cp"](arr, arrays[0], config.dp_size, n, c)
    m = max(1, max(len(r) for r in ranks))
    ranks = tuple(tuple(r) + (MicroBatch.empty(n),) * (m - len(r)) for r in ranks)
    cand = Plan(lengths=arr, dp_size=config.dp_size, cp_size=n, bucket_size=c,
                policy="skrull", dp_ranks=ranks)
    cand.validate()
    return cand, _predict(cand, cost_model, arrays[0], arrays[2], arrays[1])


def _hybrid_cpp(arr, config: SchedulerConfig, cost_model: CostModel, arrays, sub, best):
    """:func:`_hybrid_python` in the C++ core (``_C.hybrid_candidate``: grouping, the
    sub-group pricing of :func:`_micro_batch_times`, bit for bit, and the placement
    check); ``None`` when it cannot beat ``best`` (nothing built in Python then)."""
    n = config.cp_size
    latency = np.zeros(n + 1)
    for g in _subgroup_sizes(n):
        latency[g] = cost_model.comm_latency(g)
    _, got = _backend.CPP.hybrid_candidate(
        arr, arrays[0], arrays[1], arrays[2], sub[1], sub[2], latency,
        cost_model.comm_latency(n), config.dp_size, n, config.bucket_size,
        cost_model.micro_batch_overhead, cost_model.time.iteration_overhead,
        _OBJECTIVE_CODES[cost_model.objective], best, micro_batch=MicroBatch)
    if got is None:
        return None
    ranks, (count, *flat_arrays, grouped, times, valid) = got  # MicroBatch.trusted objects
    cand = Plan(lengths=arr, dp_size=config.dp_size, cp_size=n,
                bucket_size=config.bucket_size, policy="skrull",
                dp_ranks=tuple(map(tuple, ranks)))
    cand.__dict__["flat"] = FlatPlan(count, *flat_arrays, grouped, verified=valid)
    cand.validate()
    return cand, _predict(cand, cost_model, arrays[0], arrays[2], arrays[1], times)


def _subgroup_sizes(n: int) -> list[int]:
    """Hybrid CP's CP sub-group sizes at ``N = n`` ranks: the powers of two ``1 < g < N``
    (``[]`` below 3 ranks)."""
    return [1 << j for j in range(1, (n - 1).bit_length())]


def _subgroup_arrays(arr, n: int, c: int, cost_model: CostModel):
    """``(sizes, share, comm)``, each ``[K]``: every sample's hybrid-CP group size and,
    where ``1 < size < N``, its per-rank seconds and ring bandwidth seconds on that
    sub-group (0 elsewhere), the cost model evaluated once per size."""
    sizes = hybrid_size_array(arr, n, c)
    share = np.zeros(arr.size, dtype=np.float64)
    comm = np.zeros(arr.size, dtype=np.float64)
    for g in _subgroup_sizes(n):
        sel = np.flatnonzero(sizes == g)
        if sel.size:
            share[sel] = cost_model.share_seconds(arr[sel], g)
            comm[sel] = cost_model.comm_seconds(arr[sel], g)
    return sizes, share, comm


def _hybrid_floor(arr, config: SchedulerConfig, cost_model: CostModel, costs) -> float:
    """:func:`_hybrid_bound` with every sample's work and tokens at their unsharded values,
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


def _hybrid_bound(arr, config: SchedulerConfig, cost_model: CostModel, arrays,
                  sub=None) -> float:
    """A lower bound on hybrid CP's predicted iteration time, without building its plan.

    Hybrid CP gives DP rank ``d`` the ``d``-th contiguous slice of the batch and sample
    ``i`` a block of ``n_i`` ranks (``baselines.hybrid_cp_size``).  A micro-batch's time is
    at least the mean over its CP ranks of local plus sharded work, plus the overhead
    (``rank_time(x, comm, dist) >= x + dist`` under both objectives, see
    :mod:`~skrull_ext.scheduler.bound`), and a DP rank needs at least ``ceil(tokens /
    (C N))`` micro-batches; so the slowest slice's ``work / N + overhead x micro-batches``.
    ``sub``: :func:`_subgroup_arrays` of the batch, when already computed.
    """
    n, c, d = config.cp_size, config.bucket_size, config.dp_size
    sizes, share, _ = sub if sub is not None else _subgroup_arrays(arr, n, c, cost_model)
    work = np.where(sizes == 1, arrays[0], np.where(sizes == n, n * arrays[1], sizes * share))
    tokens = padded_length_array(arr, sizes)  # over g ranks: pad(S, g) tokens in all
    k, worst = arr.size, 0.0
    for j in range(min(d, k)):  # numpy.array_split's slices (empty ones add nothing)
        lo, hi = (k // d) * j + min(j, k % d), (k // d) * (j + 1) + min(j + 1, k % d)
        mbs = max(1, -(-int(tokens[lo:hi].sum()) // (c * n)))
        worst = max(worst, float(work[lo:hi].sum()) / n + cost_model.micro_batch_overhead * mbs)
    return (worst + cost_model.time.iteration_overhead) * (1.0 - 1e-12)


def _grouped_seconds(grouped, lengths, cost_model: CostModel) -> list:
    """``(first, size, share s, comm s)`` of each ``(sample, first, size)`` placement, the
    cost model evaluated once per sub-group size (not once per sample)."""
    out = [None] * len(grouped)
    for size in sorted({g[2] for g in grouped}):
        rows = [j for j, g in enumerate(grouped) if g[2] == size]
        s = np.asarray([int(lengths[grouped[j][0]]) for j in rows], dtype=np.int64)
        share = cost_model.share_seconds(s, size).tolist()
        comm = cost_model.comm_seconds(s, size).tolist()
        for j, a, b in zip(rows, share, comm):
            out[j] = (grouped[j][1], size, a, b)
    return out


def _grouped_times(rows, n: int, cost_model: CostModel) -> np.ndarray:
    """``[N]`` seconds each CP rank spends in the sub-group rings of one micro-batch.

    As the DACP attention runs them: after the full ring, one ring per sub-group
    ``(first, size)`` carrying all its samples (latency once), unoverlapped (no local
    work hides it), each priced like the full ring with no local part, sequentially.

    Args:
        rows: :func:`_grouped_seconds` of the micro-batch's grouped placements.
    """
    out = np.zeros(n, dtype=np.float64)
    rings: dict[tuple[int, int], list] = {}
    for first, size, share, comm in rows:
        ring = rings.setdefault((first, size), [0.0, 0.0])
        ring[0] += float(share)
        ring[1] += float(comm)
    for (first, size), (share, comm) in sorted(rings.items()):
        comm += cost_model.comm_latency(size) if size > 1 else 0.0
        out[first:first + size] += float(_rank_times(0.0, comm, share, size,
                                                     cost_model.objective))
    return out


def micro_batch_seconds(mb: MicroBatch, lengths, costs, comm_full, cost_model: CostModel,
                        shares=None) -> float:
    """Predicted seconds of one micro-batch, grouped placements included (0 when empty).

    ``shares`` are the per-rank seconds of each distributed sample (default ``costs / N``).
    """
    if mb.is_empty():
        return 0.0
    n = mb.cp_size
    t_local = np.array([sum(costs[i] for i in r) for r in mb.local], dtype=np.float64)
    dist = (sum(costs[i] for i in mb.distributed) / n if shares is None
            else sum(shares[i] for i in mb.distributed))
    t_dist = np.full(n, dist, dtype=np.float64)
    t_comm = np.full(n, sum(comm_full[i] for i in mb.distributed), dtype=np.float64)
    if mb.distributed:
        t_comm += cost_model.comm_latency(n)
    times = _rank_times(t_local, t_comm, t_dist, n, cost_model.objective)
    if mb.grouped:
        times = times + _grouped_times(_grouped_seconds(mb.grouped, lengths, cost_model), n,
                                       cost_model)
    return float(np.max(times)) + cost_model.micro_batch_overhead


def _rank_times(t_local, t_comm, t_dist, n: int, objective: str) -> np.ndarray:
    """:func:`reference.rank_time` elementwise over ``[..., N]`` arrays (same float ops)."""
    if objective == "paper" or n < 2:
        return np.maximum(t_comm, t_local) + t_dist
    b = t_dist / n
    c = t_comm / (n - 1)
    return np.maximum(t_local + b, c) + b + (n - 2) * np.maximum(b, c)


def _micro_batch_times(plan: Plan, flat: FlatPlan, costs, comm, cost_model: CostModel, shares):
    """:func:`micro_batch_seconds` of every micro-batch at once: ``[G]`` float64.

    ``np.bincount`` adds its weights in input (placement) order starting from 0, the same
    float operations as the per-micro-batch sums, so the results are bit-identical.
    """
    n, g = plan.cp_size, flat.count

    def sums(bins, weights, size):  # float64 even when empty (bincount then gives int64)
        return np.bincount(bins, weights=weights, minlength=size).astype(np.float64)

    t_local = sums(flat.local_slot, costs[flat.local_ids], g * n).reshape(g, n)
    dist_share = sums(flat.dist_mb, shares[flat.dist_ids], g)
    dist_comm = sums(flat.dist_mb, comm[flat.dist_ids], g)
    has_dist = np.bincount(flat.dist_mb, minlength=g) > 0
    t_dist = np.repeat(dist_share[:, None], n, axis=1)
    t_comm = np.repeat(dist_comm[:, None], n, axis=1)
    t_comm[has_dist] += cost_model.comm_latency(n)
    busy = has_dist | (np.bincount(flat.local_slot // n, minlength=g) > 0)
    rank_times = _rank_times(t_local, t_comm, t_dist, n, cost_model.objective)
    by_mb: dict[int, list] = {}
    seconds = _grouped_seconds([row[1:] for row in flat.grouped], plan.lengths, cost_model)
    for (mb, *_), row in zip(flat.grouped, seconds):
        by_mb.setdefault(mb, []).append(row)
    for mb, rows in by_mb.items():
        busy[mb] = True
        rank_times[mb] += _grouped_times(rows, n, cost_model)
    times = np.max(rank_times, axis=1) + cost_model.micro_batch_overhead
    return np.where(busy, times, 0.0)


def predict(plan: Plan, cost_model: CostModel) -> dict:
    """Cost-model prediction of a plan: per micro-batch, per DP rank, iteration, bound.

    Returns:
        ``{"iteration_time", "dp_rank_times" [D], "micro_batch_times" [D][M],
        "lower_bound"}`` in seconds.  ``iteration_time`` is the slowest DP rank's time plus
        the cost model's ``iteration_overhead``; ``lower_bound`` is
        :func:`skrull_ext.scheduler.bound.lower_bound`, which no plan of the batch that
        places samples like this one (local / distributed, or hybrid-CP sub-groups too
        when it has grouped placements) beats.
    """
    return _predict(plan, cost_model, cost_model.compute_seconds(plan.lengths),
                    cost_model.comm_seconds(plan.lengths, plan.cp_size),
                    cost_model.share_seconds(plan.lengths, plan.cp_size))


def _predict(plan: Plan, cost_model: CostModel, costs, comm, shares, times=None,
             bound=None) -> dict:
    """:func:`predict` with the plan's ``[K]`` cost arrays already computed (by schedule);
    ``times``: the C++ core's ``[G]`` micro-batch seconds under this cost model (overhead
    included, 0 when empty; the same float operations as :func:`_micro_batch_times`);
    ``bound``: the core's :func:`~skrull_ext.scheduler.bound.lower_bound` before the
    iteration overhead (see :func:`~skrull_ext.scheduler.bound.finish_bound`)."""
    flat = plan.flat
    if flat is None or flat.count == 0:
        mb_times = [[micro_batch_seconds(mb, plan.lengths, costs, comm, cost_model, shares)
                     for mb in mbs] for mbs in plan.dp_ranks]
    else:
        flat_times = (times if times is not None
                      else _micro_batch_times(plan, flat, costs, comm, cost_model, shares))
        d, m = len(plan.dp_ranks), plan.num_micro_batches
        if flat.count == d * m and all(len(mbs) == m for mbs in plan.dp_ranks):
            mb_times = flat_times.reshape(d, m).tolist()  # equal counts (every schedule())
        else:
            flat_times = flat_times.tolist()
            ends = np.cumsum([len(mbs) for mbs in plan.dp_ranks]).tolist()
            mb_times = [flat_times[end - len(mbs):end] for mbs, end in zip(plan.dp_ranks, ends)]
    rank_times = [float(sum(t)) for t in mb_times]
    fixed = cost_model.time.iteration_overhead
    return {
        "iteration_time": max(rank_times) + fixed,
        "dp_rank_times": rank_times,
        "micro_batch_times": mb_times,
        "lower_bound": (finish_bound(bound, cost_model) if bound is not None else
                        lower_bound(plan.lengths, cost_model, plan.dp_size, plan.cp_size,
                                    plan.bucket_size, arrays=(costs, shares, comm),
                                    subgroups=flat is None or bool(flat.grouped))),
    }


__all__ = ["POLICIES", "SchedulerConfig", "ScheduleInputError", "check_lengths", "predict",
           "schedule"]
