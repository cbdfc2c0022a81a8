"""Cost-model predictions of a plan: per micro-batch, per DP rank, iteration, bound.

Split from :mod:`skrull_ext.scheduler` so that the scheduler and its hybrid-CP candidate
(:mod:`~skrull_ext.scheduler.hybrid`) share one pricing without an import circle.  Every
function here repeats the float operations of the C++ core's pricing in the same order
(the parity tests compare them bit for bit).
"""
from __future__ import annotations

import numpy as np

from skrull_ext.costmodel.model import CostModel
from skrull_ext.scheduler.bound import finish_bound, lower_bound
from skrull_ext.scheduler.objective import objective_of, rank_times
from skrull_ext.scheduler.plan import FlatPlan, MicroBatch, Plan



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
    return ring_seconds([0] * len(rows), rows, 1, n, cost_model)[0]


def ring_seconds(mbs, rows, count: int, n: int, cost_model: CostModel) -> np.ndarray:
    """:func:`_grouped_times` of ``count`` micro-batches at once: ``[count, N]``.

    The same float operations: a ring's samples summed from 0 in placement order
    (``np.bincount``), each ring priced by ``rank_times`` (elementwise, per ring size), a
    micro-batch's rings added to its CP ranks from 0 in ``(first, size)`` order
    (``np.add.at`` adds repeated indices one after another).

    Args:
        mbs: ``[R]`` the micro-batch (``< count``) of each row.
        rows: ``[R]`` :func:`_grouped_seconds` rows ``(first, size, share s, comm s)``.
    """
    out = np.zeros((count, n), dtype=np.float64)
    if not rows:
        return out
    keys: dict[tuple[int, int, int], int] = {}
    ring_of = [keys.setdefault((int(m), int(r[0]), int(r[1])), len(keys))
               for m, r in zip(mbs, rows)]
    share = np.bincount(ring_of, weights=[float(r[2]) for r in rows], minlength=len(keys))
    comm = np.bincount(ring_of, weights=[float(r[3]) for r in rows], minlength=len(keys))
    key = np.asarray(list(keys), dtype=np.int64)  # [rings, 3]: mb, first, size
    seconds = np.empty(len(keys), dtype=np.float64)
    objective = objective_of(cost_model)
    for size in np.unique(key[:, 2]).tolist():
        at = key[:, 2] == size
        c = comm[at] + cost_model.comm_latency(size) if size > 1 else comm[at]
        seconds[at] = rank_times(0.0, c, share[at], size, objective)
    order = np.lexsort((key[:, 2], key[:, 1], key[:, 0]))  # by mb, first, size
    sizes = key[order, 2]
    ring = np.repeat(order, sizes)
    col = key[ring, 1] + (np.arange(ring.size) - np.repeat(np.cumsum(sizes) - sizes, sizes))
    np.add.at(out, (key[ring, 0], col), seconds[ring])
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
    times = rank_times(t_local, t_comm, t_dist, n, objective_of(cost_model))
    if mb.grouped:
        times = times + _grouped_times(_grouped_seconds(mb.grouped, lengths, cost_model), n,
                                       cost_model)
    return float(np.max(times)) + cost_model.micro_batch_overhead


def micro_batch_times(plan: Plan, flat: FlatPlan, costs, comm, cost_model: CostModel, shares):
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
    per_rank = rank_times(t_local, t_comm, t_dist, n, objective_of(cost_model))
    if flat.grouped:
        mbs = np.fromiter((row[0] for row in flat.grouped), dtype=np.int64)
        seconds = _grouped_seconds([row[1:] for row in flat.grouped], plan.lengths, cost_model)
        rings = np.unique(mbs)
        busy[rings] = True
        per_rank[rings] += ring_seconds(mbs, seconds, g, n, cost_model)[rings]
    times = np.max(per_rank, axis=1) + cost_model.micro_batch_overhead
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
    return predict_arrays(plan, cost_model, cost_model.compute_seconds(plan.lengths),
                          cost_model.comm_seconds(plan.lengths, plan.cp_size),
                          cost_model.share_seconds(plan.lengths, plan.cp_size))


def split_times(flat_times: np.ndarray, counts: list[int]) -> list[list[float]]:
    """``[G]`` micro-batch seconds in flat (DP rank major) order -> ``[D][M_d]`` lists."""
    if counts and all(m == counts[0] for m in counts) and flat_times.size == sum(counts):
        return flat_times.reshape(len(counts), counts[0]).tolist()  # every schedule()
    flat_times = flat_times.tolist()
    ends = np.cumsum(counts).tolist()
    return [flat_times[end - m:end] for m, end in zip(counts, ends)]


def iteration_seconds(mb_times: list[list[float]], cost_model: CostModel
                      ) -> tuple[list[float], float]:
    """``(dp_rank_times [D], iteration_time)`` of ``[D][M]`` micro-batch seconds: each DP
    rank's micro-batches in order (Python's left-to-right sum), the slowest rank plus the
    iteration overhead."""
    rank_seconds = [float(sum(t)) for t in mb_times]
    return rank_seconds, max(rank_seconds) + cost_model.time.iteration_overhead


def predict_arrays(plan: Plan, cost_model: CostModel, costs, comm, shares, times=None,
                   bound=None, backend: str = "python") -> dict:
    """:func:`predict` with the plan's ``[K]`` cost arrays already computed (by schedule).

    Args:
        times: The C++ core's ``[G]`` micro-batch seconds under this cost model (overhead
            included, 0 when empty; the same float operations as
            :func:`micro_batch_times`).
        bound: The core's :func:`~skrull_ext.scheduler.bound.lower_bound` before the
            iteration overhead (see :func:`~skrull_ext.scheduler.bound.finish_bound`).
        backend: Where the bound's cost arrays run when ``bound`` is not given
            (bit-identical either way).
    """
    flat = plan.flat
    if flat is None or flat.count == 0:
        mb_times = [[micro_batch_seconds(mb, plan.lengths, costs, comm, cost_model, shares)
                     for mb in mbs] for mbs in plan.dp_ranks]
    else:
        flat_times = (times if times is not None
                      else micro_batch_times(plan, flat, costs, comm, cost_model, shares))
        mb_times = split_times(flat_times, [len(mbs) for mbs in plan.dp_ranks])
    rank_seconds, iteration_time = iteration_seconds(mb_times, cost_model)
    return {
        "iteration_time": iteration_time,
        "dp_rank_times": rank_seconds,
        "micro_batch_times": mb_times,
        "lower_bound": (finish_bound(bound, cost_model) if bound is not None else
                        lower_bound(plan.lengths, cost_model, plan.dp_size, plan.cp_size,
                                    plan.bucket_size, arrays=(costs, shares, comm),
                                    subgroups=flat is None or bool(flat.grouped),
                                    backend=backend)),
    }


__all__ = ["iteration_seconds", "micro_batch_seconds", "micro_batch_times",
           "predict", "predict_arrays", "rank_times", "ring_seconds", "split_times"]
