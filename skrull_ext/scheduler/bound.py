"""A valid lower bound on any plan's predicted iteration time under a :class:`CostModel`.

Every policy's prediction (:func:`skrull_ext.scheduler.predict`) is composed per CP rank
as ``rank_time(x, t_comm, t_dist)``, which under both objectives is at least
``x + t_dist`` (local work plus the rank's share of distributed work) and is monotone in
every argument.  So for any plan:

* **work**: a DP rank's time is at least the mean over its CP ranks of their work, and a
  sample's cheapest total work over its CP group is ``w_i = min_g g share_g(S_i)`` over the
  group sizes ``g`` it fits (``g = 1``: whole on one rank, ``g = N``: distributed, and the
  power-of-two sub-groups the hybrid-CP baseline uses);
* **micro-batches**: a micro-batch holds at most ``C N`` tokens (a sample costs at least
  its length in tokens, padding only adds), so the batch needs at least
  ``ceil(sum S / (C N))`` micro-batches, each paying the fixed overhead;
* **one sample**: the DP rank holding sample ``i`` takes at least its cheapest placement
  alone, ``min(cost_i, rank_time(0, comm_i + latency, share_i))`` on its group's ``g``
  ranks, plus one overhead;
* **indivisible samples over DP ranks**: of the ``j D + 1`` samples with the most work,
  one DP rank holds ``j + 1``, so it works at least the ``j + 1`` smallest of them.

The bound is the largest of these plus the iteration overhead (less a 1e-12 relative
slack for float rounding); makespan / bound then measures the scheduler, not the bound.
"""
from __future__ import annotations

import numpy as np

from skrull_ext import _backend
from skrull_ext.sharding import shard_tokens, shard_tokens_array
from skrull_ext.scheduler.objective import objective_arg, objective_of, rank_time, rank_times


def _group_sizes(cp_size: int) -> list[int]:
    sizes, g = [], 1
    while g < cp_size:
        sizes.append(g)
        g *= 2
    return sizes + [cp_size]


def sample_bounds(lengths, cost_model, cp_size: int, bucket_size: int, *, arrays=None,
                  subgroups: bool = True, backend: str = "python"
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample ``(work, alone)``, both ``[K]`` float64 seconds.

    ``work[i]``: the least total CP-rank seconds sample ``i`` can cost (any group size it
    fits); ``alone[i]``: the least time of a micro-batch holding only sample ``i``
    (overhead excluded).

    Args:
        arrays: Optional ``(costs, shares, comm)`` of the batch for ``cp_size`` (what
            ``schedule`` already computed), saving their recomputation.
        subgroups: Also consider hybrid-CP sub-groups (``1 < g < N``); only plans with
            grouped placements can use them.
        backend: ``cpp`` runs it in the C++ core (``_C.sample_bounds``, the same float
            operations: bit-identical; ~0.6 ms against ~4.6 ms at K = 65,536, CP 8).
    """
    s = np.asarray(lengths, dtype=np.int64)
    n = cp_size
    sizes = _group_sizes(n) if subgroups else sorted({1, n})
    if backend == "cpp" and _backend.CPP is not None:
        return _backend.CPP.sample_bounds(
            s, n, bucket_size, cost_model.cost_scalars, sizes,
            [cost_model.shard_token_seconds(g) for g in sizes],
            [cost_model.comm_latency(g) for g in sizes], objective_arg(objective_of(cost_model)),
            *(arrays if arrays is not None else ()))
    work = np.full(s.shape, np.inf)
    alone = np.full(s.shape, np.inf)
    for g in sizes:
        fits = shard_tokens_array(s, g) <= bucket_size
        if g == 1:
            cost = cost_model.compute_seconds(s) if arrays is None else arrays[0]
            work = np.where(fits, np.minimum(work, cost), work)
            alone = np.where(fits, np.minimum(alone, cost), alone)
            continue
        if arrays is not None and g == n:
            share, comm = arrays[1], arrays[2] + cost_model.comm_latency(g)
        else:
            share = cost_model.share_seconds(s, g)
            comm = cost_model.comm_seconds(s, g) + cost_model.comm_latency(g)
        work = np.where(fits, np.minimum(work, g * share), work)
        t = rank_times(0.0, comm, share, g, objective_of(cost_model))  # on its g ranks
        alone = np.where(fits, np.minimum(alone, t), alone)
    return work, alone


def lower_bound(lengths, cost_model, dp_size: int, cp_size: int, bucket_size: int, *,
                arrays=None, subgroups: bool = True, backend: str = "python") -> float:
    """Seconds no plan of this batch can beat under ``cost_model`` (see module doc).

    Args:
        lengths: ``[K]`` sample lengths (each must fit the bucket distributed).
        cost_model: The scheduler's :class:`~skrull_ext.costmodel.model.CostModel`.
        dp_size, cp_size, bucket_size: ``D``, ``N``, ``C``.
        arrays, subgroups, backend: See :func:`sample_bounds`; ``subgroups=False`` bounds the plans
            our attention runs (local and fully distributed samples only).
    """
    return finish_bound(_core(lengths, cost_model, dp_size, cp_size, bucket_size,
                              arrays=arrays, subgroups=subgroups, backend=backend), cost_model)


def _core(lengths, cost_model, dp_size: int, cp_size: int, bucket_size: int, *, arrays,
          subgroups: bool, backend: str) -> float:
    """:func:`lower_bound` before :func:`finish_bound`."""
    s = np.asarray(lengths, dtype=np.int64)
    d, n = dp_size, cp_size
    ovh = cost_model.micro_batch_overhead
    if s.size == 0:
        return 0.0
    work, alone = sample_bounds(s, cost_model, n, bucket_size, arrays=arrays,
                                subgroups=subgroups, backend=backend)
    min_mbs = max(-(-int(s.sum()) // (bucket_size * n)), min(s.size, d))
    average = float(work.sum()) / (d * n) + ovh * min_mbs / d
    single = float(alone.max()) + ovh
    return max(average, single, _indivisible(work / n, d) + ovh)


# Weights mu of the ring's exchanges in the global bound's per-sample terms (see
# global_lower_bound); 1 is lower_bound's work term.
MU_GRID = (1.0, 0.5, 0.0)


def _dist_terms(shares, comm, n: int, cost_model, mu: float):
    """``(per-sample seconds, seconds per micro-batch with a ring)`` a distributed sample
    adds to its DP rank's time under the relaxation ``mu`` (see :func:`global_lower_bound`).

    :func:`~skrull_ext.scheduler.objective.rank_time` with the cost model's ring terms
    splits ``w = sum comm`` into ``frac w`` outside the ring (linear work and the dK/dV
    return) and ``(1 - frac) w`` of transfers; what is outside adds, the transfers are
    relaxed by ``mu``, and the latencies and step overheads are the per-ring constant.
    """
    lam, beta, ell, o = cost_model.ring_terms[:4]
    tot = 3.0 * (n - 1) * beta + lam + beta
    frac = (lam + beta) / tot if tot > 0.0 else 0.0
    if cost_model.objective != "ring":  # out + max(ring + 2 (n - 1) ell, x) + blocks
        return (shares + (1.0 - mu) * (1.0 - frac) * comm,
                ell + n * o + (1.0 - mu) * 2.0 * (n - 1) * ell)
    if n == 2:  # per phase max(a x + b, c) + b >= a x + 2 b
        return shares, ell + n * o
    # Per phase a x + 2 b + (n - 2) (mu b + (1 - mu) c); the phases' b sum to blocks / n
    # and their c to ring / (n - 1) + 2 ell.
    g, k = (2.0 + (n - 2) * mu) / n, (n - 2) * (1.0 - mu) / (n - 1)
    return (g * shares + (frac * (1.0 - g) + k * (1.0 - frac)) * comm,
            ell + g * n * o + 2.0 * (n - 2) * (1.0 - mu) * ell)


def _forced_core(s, costs, comm, shares, forced, cost_model, d: int, n: int, c: int,
                 groups=(), limit: float = np.inf, top: float = np.inf) -> float:
    """The largest average / indivisible term over :data:`MU_GRID` when the samples in
    ``forced`` (``[K]`` bool) must be distributed; ``inf`` when one of them cannot be.

    ``groups``: ``(g, shares_g, comm_g, alone_g)`` of the sub-group sizes ``1 < g < n`` a
    plan may also ring a sample on (:func:`_subgroup_terms`); empty for DACP's plans.  A
    sub-group placement whose ``alone_g`` exceeds ``limit`` (the slowest DP rank's time,
    at most ``top``, being bounded) is not an option.

    Under ``paper`` a sample kept local on rank ``r`` adds ``(mu cost_i + (1 - mu) e_i) /
    n`` (``e_i``: :func:`_exposed`), valid with sub-group rings too: with a full ring rank
    ``r`` takes ``out + blocks + max(c', x_r)`` (``c' = R + L``, see :func:`_exposed_total`)
    and ``max(c', x) >= mu x + (1 - mu) (c' + max(0, x - c'))``; the ``c'`` part and ``out +
    blocks`` are the ring's per-sample and per-ring terms (:func:`_dist_terms`), and
    ``max(0, x_r - c') >= sum e_i`` over its local samples; without a full ring it takes
    ``x_r >= sum cost_i >= sum e_i``.  Sub-group rings run after that on their ranks, so
    their time adds on each of them; every term is a sum over one rank's samples, so the
    mean over the ``n`` ranks (average term) and a DP rank's sum over its samples
    (indivisible term) take them per sample.  The leaders' term (:func:`_exposed_total`)
    takes a maximum over ranks instead, which a sub-group ring on another rank may
    already be paying for: it stays DACP's."""
    ovh = cost_model.micro_batch_overhead
    fits_local = (s <= c) & ~forced
    fits_dist = shard_tokens_array(s, n) <= c
    fits_sub = [(shard_tokens_array(s, g) <= c) & (alone_g <= limit)
                for g, _, _, alone_g in groups]
    if not (fits_local | fits_dist | np.logical_or.reduce(fits_sub, initial=False)).all():
        return np.inf
    min_mbs = max(-(-int(s.sum()) // (c * n)), min(s.size, d))
    if not forced.any():
        ring_mbs = 0
    elif groups:  # a ring of any size holds a sample's tokens; a micro-batch n c of them
        ring_mbs = -(-int(s[forced].sum()) // (c * n))
    else:
        ring_mbs = -(-int(shard_tokens_array(s[forced], n).sum()) // c)
    best = 0.0
    paper = cost_model.objective != "ring"
    exposed = _exposed(s, costs, cost_model, n, c, top) if paper else None
    for mu in MU_GRID:
        dist, ring = _dist_terms(shares, comm, n, cost_model, mu)
        local = (mu * costs + (1.0 - mu) * exposed) / n if paper else costs / n
        per = np.minimum(np.where(fits_local, local, np.inf), np.where(fits_dist, dist, np.inf))
        for (g, share_g, comm_g, _), fits in zip(groups, fits_sub):
            sub, ring_g = _dist_terms(share_g, comm_g, g, cost_model,
                                      mu if cost_model.objective == "ring" else 0.0)
            per = np.minimum(per, np.where(fits, g / n * sub, np.inf))
            ring = min(ring, g / n * ring_g)
        average = (float(per.sum()) + ring * ring_mbs) / d
        if mu == 0.0 and not groups and paper:
            total = _exposed_total(s, costs, np.where(fits_dist, dist, np.inf), fits_local,
                                   cost_model, n, c, top)
            average = max(average, (total + ring * ring_mbs) / d)
        best = max(best, average + ovh * min_mbs / d, _indivisible(per, d) + ovh)
    return best


# Per-rank counts q of the leaders' bound: samples longer than C / (q + 1) (q per rank).
LEADER_COUNTS = (1, 2)


def _exposed_total(s, costs, dist, keep_ok, cost_model, n: int, c: int,
                   top: float = np.inf) -> float:
    """A larger stand-in for ``sum(per)`` of :func:`_forced_core` under ``paper`` at
    ``mu = 0`` (local work free): it also counts the local work a long local sample leaves
    exposed in its micro-batch (``-inf`` when no sample is long; the largest over
    :data:`LEADER_COUNTS`).

    Why it holds: with a full ring a micro-batch takes its overhead, the ring's latency
    terms, ``sum dist`` over its ringed samples and ``max(0, X - R - L)``: ``X`` its
    largest rank's local work, ``R`` the ring's exposed transfers (``3 (n - 1) beta``
    per shard token per rank), ``L = 2 (n - 1) ell``.  A local sample ``i`` on a rank
    leaves the ring at most ``C - S_i`` shard tokens per rank (the bucket), and at most
    ``sigma_T = (T - overhead - latency) / shard_token_seconds(n)`` when the slowest DP
    rank takes at most ``T = top`` (every ringed shard token costs its ranks at least
    ``lam + beta`` of ``shares`` and ``3 (n - 1) beta`` of transfers); with ``X >= cost_i``
    the last term is at least ``e_i = cost_i - 3 (n - 1) beta min(C - S_i, sigma_T) - L``
    (0 if less); without a ring the micro-batch takes ``X >= e_i``.  ``e`` grows with
    ``S``.  A micro-batch holds at most ``cap = q n`` local samples longer than ``C / (q +
    1)``; of those a plan keeps local, in descending length, the ones at positions ``k
    cap + 1`` ("leaders") lie in ``k + 1`` different micro-batches, each exposing at least
    its leader's ``e``.  Summed over all micro-batches the plan pays every leader's ``e``
    and every ringed sample's ``dist``; the least of that over which long samples ring is
    a DP over the kept count mod ``cap`` (``O(P cap)`` for ``P`` long samples); the other
    samples take ``min(0 local, dist)`` as before.

    Args:
        s, costs: ``[K]`` lengths and whole-sample seconds.
        dist: ``[K]`` each sample's ring term at ``mu = 0`` (``inf`` where it cannot ring).
        keep_ok: ``[K]`` bool, samples that may stay local (fit, not forced).
        top: ``T``, the most seconds of the slowest DP rank (iteration overhead excluded).
    """
    exposed = _exposed(s, costs, cost_model, n, c, top)
    per = np.where(keep_ok, 0.0, dist)
    best = -np.inf
    for q in LEADER_COUNTS:
        pick = keep_ok & (s > c // (q + 1)) & (exposed > 0.0)
        if not pick.any():
            continue
        order = np.flatnonzero(pick)[np.argsort(-s[pick], kind="stable")]
        kept = _kept_dp(dist[order], exposed[order], min(q * n, order.size))
        best = max(best, float(per[~pick].sum()) + kept)
    return best


def _exposed(s, costs, cost_model, n: int, c: int, top: float) -> np.ndarray:
    """``[K]`` ``e_i``: the local work sample ``i`` kept whole on a rank leaves exposed in
    its micro-batch's time on that rank, beyond the full ring's (see
    :func:`_exposed_total`); 0 where a ring may hide all of it.

    Several samples on one rank expose at least the sum of their ``e`` (the rank's
    exposed work is ``max(0, x_r - R - L)`` with ``R + L <= K_i`` for each of its samples
    ``i``, ``e_i = max(0, cost_i - K_i)``, and ``max(0, a + b - K) >= max(0, a - K) +
    max(0, b - K)`` for ``a, b, K >= 0``)."""
    beta, ell = cost_model.ring_terms[1:3]
    sigma = (top - cost_model.micro_batch_overhead - cost_model.comm_latency(n)) / max(
        cost_model.shard_token_seconds(n), 1e-300)
    room = np.minimum(c - s, max(sigma, 0.0))
    return np.maximum(costs - 3.0 * (n - 1) * beta * room - 2.0 * (n - 1) * ell, 0.0)


def _kept_dp(dist, lead, cap: int) -> float:
    """Least total when each sample (in order) rings at ``dist`` or stays local, paying
    ``lead`` if it is the ``(k cap + 1)``-th one kept."""
    best = np.full(cap, np.inf)  # best[r]: least seconds so far with (kept count % cap) = r
    best[0] = 0.0
    step = np.zeros(cap)
    for d_i, l_i in zip(dist.tolist(), lead.tolist()):
        step[0] = l_i
        best = np.minimum(best + d_i, np.roll(best + step, 1))
    return float(best.min())


def _subgroup_terms(s, cost_model, n: int) -> list:
    """``(g, shares_g, comm_g, alone_g)`` (``[K]`` float64 seconds) of every power-of-two
    sub-group size ``1 < g < n``; ``alone_g``: the least time of a micro-batch holding the
    sample on ``g`` ranks, overhead included (its ring's time on those ranks, alone:
    ``rank_time`` is monotone, so other samples only add).  A sub-group ring runs after
    the full ring with no local work beside it (``pricing._grouped_times``), so under
    ``paper`` its transfers are exposed (``_dist_terms`` at ``mu = 0``); under ``ring`` the
    full ring's relaxation (valid for any local work, none included) applies on ``g``
    ranks.  Each of its ``g`` ranks spends the per-rank term, so it adds ``g / n`` of it
    to the mean over the ``n`` CP ranks."""
    out = []
    for g in _group_sizes(n)[1:-1]:
        share, comm = cost_model.share_seconds(s, g), cost_model.comm_seconds(s, g)
        alone = rank_times(0.0, comm + cost_model.comm_latency(g), share, g,
                           objective_of(cost_model)) + cost_model.micro_batch_overhead
        out.append((g, share, comm, alone))
    return out


def _indivisible(per, d: int) -> float:
    """Of the ``j d + 1`` samples with the largest ``per``, one DP rank holds ``j + 1``:
    the largest sum of the ``j + 1`` smallest of them over ``j``."""
    ranked = np.sort(per)[::-1]
    prefix = np.concatenate([[0.0], np.cumsum(ranked)])
    j = np.arange(1, (per.size - 1) // d + 1)
    top = j * d + 1
    return float((prefix[top] - prefix[top - j - 1]).max()) if j.size else 0.0


def global_lower_bound(lengths, cost_model, dp_size: int, cp_size: int, bucket_size: int, *,
                       backend: str = "python", subgroups: bool = False) -> float:
    """A tighter bound than :func:`lower_bound` on plans of local and fully distributed
    samples (what DACP places), for benchmarks (O(K log^2 K)); ``subgroups=True`` bounds
    plans with sub-group rings too (hybrid CP, dynamic CP: :func:`_subgroup_terms`).

    It adds what cannot be split across a micro-batch:

    * a micro-batch holding sample ``i`` whole takes at least ``cost_i`` plus the
      overhead, so if the best plan's slowest DP rank takes ``T``, every sample with
      ``cost_i + overhead > T`` is distributed there (and one that does not fit whole
      always is);
    * a micro-batch with distributed samples pays its ring: under ``ring`` each phase's
      ``max(a x + b, c) + b + (n - 2) max(b, c)`` is at least ``a x + 2b + (n - 2)(mu b +
      (1 - mu) c)`` for any ``mu`` in [0, 1] (local work overlaps only the first
      exchange), under ``paper`` ``max(c', x)`` is at least ``mu x + (1 - mu) c'``; the
      work outside the ring adds (:func:`_dist_terms`); all sum over samples, the ring's
      latencies and step overheads once per micro-batch with a ring (at least
      ``ceil(forced shards / C)`` of them).

    * under ``paper`` a long sample kept local exposes work its micro-batch's ring cannot
      hide: on its own rank (``e_i / n`` of the mean over CP ranks, also with sub-group
      rings: :func:`_forced_core`), and as the leader of its micro-batch
      (:func:`_exposed_total`, DACP's plans);
    * likewise a sub-group placement whose ring alone takes more than ``T`` is out
      (``subgroups=True``).

    With those per-sample terms, the average and indivisible terms of :func:`lower_bound`
    give ``f(T)``, non-increasing in ``T`` (fewer samples are forced, more placements
    allowed); the best plan's ``T`` satisfies ``T >= f(T)``, so the bound is the least such
    ``T`` (a binary search over the samples' ``cost_i + overhead`` and sub-group times),
    never below :func:`lower_bound`.
    """
    s = np.asarray(lengths, dtype=np.int64)
    d, n, c = dp_size, cp_size, bucket_size
    if s.size == 0:
        return finish_bound(0.0, cost_model)
    costs, comm, shares = cost_model.schedule_arrays(s, n, backend=backend)
    core = _core(s, cost_model, d, n, c, arrays=(costs, shares, comm), subgroups=subgroups,
                 backend=backend)
    if n < 2:
        return finish_bound(core, cost_model)
    groups = _subgroup_terms(s, cost_model, n) if subgroups else ()
    alone = np.where(s <= c, costs + cost_model.micro_batch_overhead, np.inf)
    times = np.concatenate([alone] + [g[3] for g in groups])
    edges = np.concatenate([[0.0], np.unique(times[np.isfinite(times)]), [np.inf]])

    def f(q: int) -> float:  # f(T) for T in [edges[q], edges[q + 1])
        return _forced_core(s, costs, comm, shares, alone > edges[q], cost_model, d, n, c,
                            groups, edges[q], edges[q + 1])

    lo, hi = 0, edges.size - 2  # the first q with f(q) < edges[q + 1] (monotone)
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid) < edges[mid + 1]:
            hi = mid
        else:
            lo = mid + 1
    return finish_bound(max(core, f(lo), edges[lo]), cost_model)


def finish_bound(core: float, cost_model) -> float:
    """The bound from its largest term ``core`` (the C++ core computes that one too,
    ``skrull::plan_lower_bound``): plus the iteration overhead, less a relative 1e-12
    (the plans' predictions add the same terms in other orders)."""
    return (core + cost_model.time.iteration_overhead) * (1.0 - 1e-12)


def plan_lower_bound(ctx, dp_size: int, overhead: float) -> float:
    """The batch's lower bound on the slowest DP rank's time, local and distributed
    placements only, on a :class:`~skrull_ext.scheduler.reference.GdsContext`: where ruin
    and recreate stops.  ``skrull::plan_lower_bound`` (csrc/bound.cpp), the same float
    operations (so both backends stop at the same point)."""
    n, cap = ctx.cp_size, ctx.bucket_size
    k = len(ctx.lengths)
    if k == 0:
        return 0.0
    inf = float("inf")
    work, alone_max, work_sum, tokens = [], -inf, 0.0, 0
    for i in range(k):
        s = int(ctx.lengths[i])
        tokens += s
        w = a = inf
        if s <= cap:
            w = a = float(ctx.costs[i])
        if n > 1 and shard_tokens(s, n) <= cap:
            sh = float(ctx.costs[i]) / n if ctx.shares is None else float(ctx.shares[i])
            w = min(w, n * sh)
            a = min(a, rank_time(0.0, float(ctx.comm[i]) + ctx.latency, sh, n, ctx.objective))
        work.append(w)
        work_sum += w
        alone_max = max(alone_max, a)
    per = cap * n
    min_mbs = max((tokens + per - 1) // per, min(k, dp_size))
    average = work_sum / (float(dp_size) * n) + overhead * float(min_mbs) / dp_size
    work.sort(reverse=True)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w / n)
    group = 0.0
    for j in range(1, (k - 1) // dp_size + 1):
        top = j * dp_size + 1
        group = max(group, prefix[top] - prefix[top - j - 1])
    return max(average, alone_max + overhead, group + overhead)


__all__ = ["MU_GRID", "finish_bound", "global_lower_bound", "lower_bound", "plan_lower_bound",
           "sample_bounds"]
