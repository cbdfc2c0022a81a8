"""Pure-Python reference of the Skrull scheduler: the readable specification.

Implements docs/design.md sections 3 (DACP) and 4 (GDS) on plain arrays.  The C++ core
(``csrc/``) mirrors every function here step for step and must return identical plans;
``tests/test_parity.py`` checks that.  Rules both implementations follow so they agree
bit for bit:

* Inputs are ``lengths`` (int64), ``costs`` (float64 compute seconds of a whole sequence),
  optional ``shares`` (float64 compute seconds each CP rank spends on a distributed
  sequence; ``costs[i] / N`` when omitted), ``comm`` (float64 ring seconds of a
  distributed sequence) and ``latency``
  (ring seconds paid once by a micro-batch with any distributed sequence), precomputed by
  :class:`skrull_ext.costmodel.model.CostModel`; the core never evaluates a cost function
  itself.  :func:`rank_time` (:mod:`skrull_ext.scheduler.objective`) composes them; with
  the cost model's :class:`~skrull_ext.scheduler.objective.Objective` part of ``comm`` and
  ``shares`` is the linear work that runs outside the ring.
* Float accumulations happen in the same order in both (C++ is built without FMA
  contraction), and every tie is broken by the lowest rank / sample index.

Placements are lists: ``distributed`` sample ids in placement order and ``local[r]`` the
ids held whole by CP rank ``r`` in placement order.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple, Optional, Sequence

from skrull_ext.sharding import shard_tokens
from skrull_ext.scheduler.objective import rank_time  # noqa: F401 (the spec's composition)

ROLLBACK_POLICIES = ("shortest", "best-fit", "auto")
DACP_VARIANTS = ("paper", "balanced", "lpt", "auto")
OBJECTIVES = ("paper", "ring")
# GDS tries this many micro-batch counts one by one before galloping (_fewest_split).
LINEAR_COUNTS = 16

Placement = tuple[list[int], list[list[int]]]  # (distributed, local per CP rank)


def _argmin(values: Sequence) -> int:
    best = 0
    for j in range(1, len(values)):
        if values[j] < values[best]:
            best = j
    return best


def _argmax(values: Sequence) -> int:
    best = 0
    for j in range(1, len(values)):
        if values[j] > values[best]:
            best = j
    return best


def _share(costs, shares, i: int, n: int) -> float:
    """Seconds each of ``n`` ranks spends on distributed sequence ``i``."""
    return costs[i] / n if shares is None else shares[i]


def _fits(rem: list[int], length: int, cp_size: int) -> bool:
    """Whether steps a-c of DACP can place a sequence of ``length`` with budgets ``rem``."""
    return max(rem) >= length or min(rem) >= shard_tokens(length, cp_size)


def _choose_victim(local_r: list[int], lengths, rem: list[int], r: int, need: int,
                   cp_size: int, policy: str) -> int:
    """Position in ``local_r`` of the local sequence to demote to distributed.

    ``shortest`` (the paper): the shortest one.  ``best-fit`` (ours): the shortest one
    whose demotion lets the pending sequence of ``need`` tokens be placed; the shortest
    when none does (the loop then demotes again).  Ties: earliest placed.
    """
    shortest = 0
    for p in range(1, len(local_r)):
        if lengths[local_r[p]] < lengths[local_r[shortest]]:
            shortest = p
    if policy == "shortest":
        return shortest
    best = -1
    for p, v in enumerate(local_r):
        lv = int(lengths[v])
        sv = shard_tokens(lv, cp_size)
        trial = [x - sv for x in rem]
        trial[r] += lv
        if min(trial) < 0 or not _fits(trial, need, cp_size):
            continue
        if best < 0 or lv < lengths[local_r[best]]:
            best = p
    return shortest if best < 0 else best


def micro_batch_time(placement: Placement, costs, comm, latency: float, cp_size: int,
                     shares=None, objective: str = "paper") -> float:
    """Predicted seconds of one placed micro-batch (docs/design.md section 3 objective).

    ``max_j rank_time(T_comp(local_j), T_comm(distributed), T_comp(distributed) / N)``
    (:func:`rank_time`); the caller adds the fixed per-micro-batch overhead.
    """
    dist, local = placement
    t_comm = 0.0
    t_dist = 0.0
    for i in dist:
        t_comm += comm[i]
        t_dist += _share(costs, shares, i, cp_size)
    if dist:
        t_comm += latency
    worst = 0.0
    for rank in local:
        t_local = 0.0
        for i in rank:
            t_local += costs[i]
        t = rank_time(t_local, t_comm, t_dist, cp_size, objective)
        if t > worst:
            worst = t
    return worst


def _objective(local_load, t_comm: float, t_dist: float, r: int = -1, extra: float = 0.0,
               objective: str = "paper") -> float:
    """``max_j rank_time(local_j, t_comm, t_dist)`` with ``extra`` added to rank ``r``'s load."""
    worst = 0.0
    n = len(local_load)
    for j, x in enumerate(local_load):
        if j == r:
            x = x + extra
        t = rank_time(x, t_comm, t_dist, n, objective)
        if t > worst:
            worst = t
    return worst


def _roll_back(local, rem, lengths, need: int, n: int, rollback: str):
    """Step d: demotes a local sequence of the fullest rank to distributed.

    Frees its tokens on that rank and charges its shard to every rank (``local`` and
    ``rem`` are updated in place).  Returns ``(rank, victim)``, or ``None`` when nothing
    can be demoted (no local sequence there, one rank only, or the shard would overflow).
    """
    r = _argmin(rem)
    if n == 1 or not local[r]:
        return None  # with one rank a demotion frees nothing
    p = _choose_victim(local[r], lengths, rem, r, need, n, rollback)
    v = local[r][p]
    lv = int(lengths[v])
    sv = shard_tokens(lv, n)
    if rem[r] + lv < sv or any(rem[j] < sv for j in range(n) if j != r):
        return None  # the demoted sequence itself would overflow a rank
    del local[r][p]
    rem[r] += lv
    for j in range(n):
        rem[j] -= sv
    return r, v


def dacp_place(lengths, costs, idx: Sequence[int], cp_size: int, bucket_size: int,
               rollback: str = "shortest", shares=None, *, balanced: bool = False,
               comm=None, latency: float = 0.0, objective: str = "paper"
               ) -> Optional[Placement]:
    """DACP (docs/design.md section 3) for one micro-batch on one CP group.

    Sequences go in ascending (length, index) order: a) local on the rank with the least
    local compute if it has room, b) else local on the rank with the most room, c) else
    distributed if every rank has room for its shard, d) else roll back and retry.

    With ``balanced`` (ours), step a distributes the sequence instead when that strictly
    lowers the micro-batch objective (:func:`micro_batch_time`) and every rank has room:
    the paper's rule keeps every sequence that fits local, so the longest sequences of a
    micro-batch land whole on one rank and dominate its compute.

    Args:
        lengths: ``[K]`` token lengths of the global batch.
        costs: ``[K]`` compute seconds of each whole sequence.
        idx: Sample ids of this micro-batch.
        cp_size: CP ranks ``N``.
        bucket_size: Token budget ``C`` of each rank.
        rollback: ``shortest`` or ``best-fit`` victim choice.
        shares: ``[K]`` per-rank seconds of a distributed sequence (default ``costs / N``).
        balanced: Use the objective test in step a (needs ``comm`` and ``latency``).
        comm: ``[K]`` ring seconds of each distributed sequence.
        latency: Ring seconds of a micro-batch with any distributed sequence.
        objective: :func:`rank_time` composition used by ``balanced``.

    Returns:
        ``(distributed, local)`` or ``None`` when the micro-batch is infeasible.
    """
    n = cp_size
    order = sorted(idx, key=lambda i: (int(lengths[i]), i))
    rem = [int(bucket_size)] * n
    local_load = [0.0] * n  # compute of each rank's local sequences
    dist_load = 0.0  # per-rank compute of the distributed ones (the same on every rank)
    comm_sum = 0.0
    local: list[list[int]] = [[] for _ in range(n)]
    dist: list[int] = []
    for i in order:
        s = int(lengths[i])
        sh = shard_tokens(s, n)
        while True:
            r = _argmin(local_load)
            if rem[r] < s:
                r = _argmax(rem)
            can_dist = n > 1 and min(rem) >= sh
            if rem[r] >= s:
                if balanced and can_dist:
                    t_comm = comm_sum + latency if dist else 0.0
                    keep = _objective(local_load, t_comm, dist_load, r, costs[i], objective)
                    move = _objective(local_load, comm_sum + comm[i] + latency,
                                      dist_load + _share(costs, shares, i, n), objective=objective)
                    can_dist = move < keep
                else:
                    can_dist = False
                if not can_dist:
                    local[r].append(i)
                    rem[r] -= s
                    local_load[r] += costs[i]
                    break
            if can_dist:
                v = i
                for j in range(n):
                    rem[j] -= sh
            else:
                demoted = _roll_back(local, rem, lengths, s, n, rollback)
                if demoted is None:
                    return None
                r, v = demoted
                local_load[r] -= costs[v]
            dist.append(v)
            if comm is not None:
                comm_sum += comm[v]
            dist_load += _share(costs, shares, v, n)
            if v == i:  # placed; after a roll-back, retry the same sequence
                break
    return dist, local


def _lpt_local(rest: Sequence[int], lengths, costs, n: int, cap: int, t_comm: float,
               t_dist: float, objective: str, best_t: Optional[float] = None
               ) -> Optional[tuple[list[list[int]], float]]:
    """Each of ``rest`` (in order) to the least-loaded rank with room.

    Returns ``(local, t)`` with ``t`` the micro-batch's :func:`micro_batch_time` (the
    loads summed here, in placement order, are the ones it would sum), or ``None`` if a
    sample fits no rank or, with ``best_t``, as soon as a rank's :func:`rank_time` reaches
    ``best_t`` (loads only grow, so the candidate cannot win).
    """
    rem = [cap] * n
    load = [0.0] * n
    local: list[list[int]] = [[] for _ in range(n)]
    for i in rest:
        s = int(lengths[i])
        r = -1
        for j in range(n):
            if rem[j] >= s and (r < 0 or load[j] < load[r]):
                r = j
        if r < 0:
            return None
        local[r].append(i)
        rem[r] -= s
        load[r] += costs[i]
        if best_t is not None and rank_time(load[r], t_comm, t_dist, n, objective) >= best_t:
            return None
    worst = 0.0
    for x in load:
        worst = max(worst, rank_time(x, t_comm, t_dist, n, objective))
    return local, worst


def _lpt_bounds(order, lengths, costs, comm, latency: float, n: int, bucket_size: int,
                shares, objective: str) -> list[tuple[float, int, int, float, float]]:
    """Every feasible ``k`` of :func:`dacp_place_lpt` with its lower bound, best bound first.

    Returns ``(bound, k, shard_sum, t_comm, t_dist)`` rows sorted by ``(bound, k)``, ``k``
    up to the last count whose shards fit the bucket.  ``bound`` is ``rank_time(x, T_comm,
    T_dist)`` with ``x`` the most of three loads the slowest rank holds at least: the mean
    of the local rest, its largest sample, and its ``q = ceil(rest count / N)`` smallest
    samples (some rank holds ``q`` of them), which is exact for equal samples.
    """
    count = len(order)
    suffix, top = [0.0] * (count + 1), [0.0] * (count + 1)
    for p in range(count - 1, -1, -1):
        suffix[p] = suffix[p + 1] + costs[order[p]]
        top[p] = max(top[p + 1], costs[order[p]])
    rows = []
    shard_sum, comm_sum, dist_load = 0, 0.0, 0.0
    for k in range(count + 1):
        if k:
            if n == 1:
                break
            i = order[k - 1]
            shard_sum += shard_tokens(int(lengths[i]), n)
            if shard_sum > bucket_size:
                break
            comm_sum += comm[i]
            dist_load += _share(costs, shares, i, n)
        t_comm = comm_sum + latency if k else 0.0
        q = -(-(count - k) // n)
        x = max(suffix[k] / n, top[k], suffix[count - q])
        bound = rank_time(x, t_comm, dist_load, n, objective)
        rows.append((bound, k, shard_sum, t_comm, dist_load))
    rows.sort(key=lambda row: (row[0], row[1]))
    return rows


def dacp_place_lpt(lengths, costs, comm, latency: float, idx: Sequence[int], cp_size: int,
                   bucket_size: int, shares=None, objective: str = "paper",
                   limit: Optional[float] = None) -> Optional[Placement]:
    """(ours) Distribute the ``k`` longest sequences, pack the rest local by LPT; best ``k``.

    The paper's step a (and the balanced variant) place sequences shortest first, one at a
    time, so local sequences cannot be balanced against each other: the balanced variant
    then distributes short sequences merely to even out the ranks.  Here the ``k`` longest
    sequences (ties: lower index first) are distributed and the others go longest first to
    the least-loaded rank with room (ties: lowest rank); the ``k`` with the lowest
    :func:`micro_batch_time` wins.

    The counts are tried in ascending order of a lower bound (:func:`_lpt_bounds`, ties:
    smaller ``k``) and the search stops at the first count whose bound reaches the best
    time so far: with many short sequences the packed time sits just above the bound, so
    the best count comes early and few others are packed (trying ``k = 0, 1, ...`` in turn
    packed nearly every count; same plans up to exact ties between counts, which keep the
    one tried first).  With ``limit`` only a time strictly below it counts (the caller's
    best other candidate); ``None`` when no count is feasible and below ``limit``.
    """
    n = cp_size
    order = sorted(idx, key=lambda i: (-int(lengths[i]), i))
    best, best_t = None, limit
    for bound, k, shard_sum, t_comm, t_dist in _lpt_bounds(order, lengths, costs, comm, latency,
                                                           n, bucket_size, shares, objective):
        if best_t is not None and bound >= best_t:
            break
        packed = _lpt_local(order[k:], lengths, costs, n, int(bucket_size) - shard_sum, t_comm,
                            t_dist, objective, best_t)
        if packed is not None:
            best, best_t = (list(order[:k]), packed[0]), packed[1]
    return best


def _candidates(rollback: str, variant: str) -> list[tuple[str, str]]:
    """``dacp_best``'s ``(variant, roll-back)`` candidates in order (lpt has no roll-back)."""
    rollbacks = ("shortest", "best-fit") if rollback == "auto" else (rollback,)
    variants = ("paper", "balanced", "lpt") if variant == "auto" else (variant,)
    return [(var, rb) for var in variants for rb in (rollbacks if var != "lpt" else ("none",))]


def dacp_best(lengths, costs, comm, latency, idx, cp_size, bucket_size, rollback,
              variant: str = "paper", shares=None, objective: str = "paper"):
    """DACP with the chosen roll-back and variant; ``auto`` tries each, keeps the fastest.

    Candidates in order (ties keep the earlier): paper/shortest, paper/best-fit,
    balanced/shortest, balanced/best-fit, lpt (no roll-back), restricted to the requested
    settings.  lpt, the costliest, runs last with the best time so far as its limit.
    """
    best, best_t = None, 0.0
    for var, rb in _candidates(rollback, variant):
        if var == "paper":
            cand = dacp_place(lengths, costs, idx, cp_size, bucket_size, rb, shares)
        elif var == "lpt":
            cand = dacp_place_lpt(lengths, costs, comm, latency, idx, cp_size, bucket_size,
                                  shares, objective, None if best is None else best_t)
        else:
            cand = dacp_place(lengths, costs, idx, cp_size, bucket_size, rb, shares,
                              balanced=True, comm=comm, latency=latency, objective=objective)
        if cand is None:
            continue
        t = micro_batch_time(cand, costs, comm, latency, cp_size, shares, objective)
        if best is None or t < best_t:
            best, best_t = cand, t
    return best


def dacp_feasible(lengths, costs, comm, latency, idx, cp_size, bucket_size, rollback,
                  variant: str = "paper", shares=None, objective: str = "paper") -> bool:
    """Whether :func:`dacp_best` places ``idx``: some candidate does (cheapest first).

    The micro-batch count search only needs this answer for every count but the last.
    """
    for var, rb in _candidates(rollback, variant):
        if var == "lpt":
            cand = dacp_place_lpt(lengths, costs, comm, latency, idx, cp_size, bucket_size,
                                  shares, objective)
        else:
            cand = dacp_place(lengths, costs, idx, cp_size, bucket_size, rb, shares,
                              balanced=var == "balanced", comm=comm, latency=latency,
                              objective=objective)
        if cand is not None:
            return True
    return False


def lpt_partition(costs, idx: Sequence[int], bins: int) -> list[list[int]]:
    """Longest-processing-time bin packing (GDS step 1).

    Sorts by cost descending (ties: lower index first) and gives each sample to the
    least-loaded bin (ties: lowest bin).  Returns ``bins`` lists of sample ids.
    """
    order = sorted(idx, key=lambda i: (-costs[i], i))
    heap = [(0.0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return out


def interleave(sorted_idx: Sequence[int], m: int) -> list[list[int]]:
    """GDS step 3: micro-batch ``j`` takes ``sorted[j], sorted[j+m], sorted[j+2m], ...``."""
    return [list(sorted_idx[j::m]) for j in range(m)]


class GdsContext(NamedTuple):
    """What the GDS helpers share: the batch's arrays and the scheduling settings."""

    lengths: Sequence[int]
    costs: Sequence[float]
    comm: Sequence[float]
    latency: float
    cp_size: int
    bucket_size: int
    rollback: str
    variant: str
    shares: Optional[Sequence[float]]
    objective: str

    def place(self, idx) -> Optional[Placement]:
        return dacp_best(self.lengths, self.costs, self.comm, self.latency, idx, self.cp_size,
                         self.bucket_size, self.rollback, self.variant, self.shares,
                         self.objective)

    def feasible(self, idx) -> bool:
        return dacp_feasible(self.lengths, self.costs, self.comm, self.latency, idx,
                             self.cp_size, self.bucket_size, self.rollback, self.variant,
                             self.shares, self.objective)

    def split_time(self, split, overhead: float) -> float:
        """Predicted seconds of one DP rank's micro-batches (empty ones cost nothing)."""
        t = 0.0
        for placement in split:
            if placement[0] or any(placement[1]):
                t += micro_batch_time(placement, self.costs, self.comm, self.latency,
                                      self.cp_size, self.shares, self.objective) + overhead
        return t


def _split_rank(ctx: GdsContext, seqs, m: int, check_only: bool = False
                ) -> Optional[list[Placement]]:
    """Interleave into ``m`` micro-batches and place each; ``None`` if any is infeasible.

    ``check_only``: only decide feasibility (:func:`dacp_feasible`, cheapest variant
    first); ``[]`` when feasible.
    """
    cap = ctx.bucket_size * ctx.cp_size
    out = []
    for g in interleave(seqs, m):
        if sum(int(ctx.lengths[i]) for i in g) > cap:
            return None
        if check_only:
            if not ctx.feasible(g):
                return None
            continue
        placed = ctx.place(g)
        if placed is None:
            return None
        out.append(placed)
    return out


def can_pair(sx: int, sy: int, cp_size: int, bucket_size: int) -> bool:
    """Whether sequences of ``sx`` and ``sy`` tokens fit one micro-batch together."""
    n, c = cp_size, bucket_size
    if sx + sy <= c or (n > 1 and sx <= c and sy <= c):
        return True  # both local (one rank, or two ranks)
    if n == 1:
        return False
    hx, hy = shard_tokens(sx, n), shard_tokens(sy, n)
    return (sx <= c and hy <= c - sx) or (sy <= c and hx <= c - sy) or hx + hy <= c


def _isolate(ctx: GdsContext, seqs) -> tuple[list[int], list[int]]:
    """(ours) Splits off the samples that fit no micro-batch with any other sample.

    Such a sample (its shard fills almost the whole bucket) would make every interleaved
    split infeasible until there is one sample per micro-batch; it gets a micro-batch of
    its own instead.  If it cannot pair with the rank's shortest other sample it can pair
    with none.  Returns ``(rest, alone)``, both in ``seqs`` order.
    """
    if len(seqs) < 2:
        return list(seqs), []
    rest, alone = [], []
    for i in seqs:
        other = seqs[1] if i == seqs[0] else seqs[0]
        fits = can_pair(int(ctx.lengths[i]), int(ctx.lengths[other]), ctx.cp_size,
                        ctx.bucket_size)
        (rest if fits else alone).append(i)
    return rest, alone


def _plan_rank(ctx: GdsContext, seqs, m: Optional[int] = None) -> Optional[list[Placement]]:
    """One DP rank's micro-batches: the fewest feasible (``m=None``) or exactly ``m``.

    GDS steps 2-4 on the samples that can share, then one micro-batch per isolated sample.
    """
    rest, alone = _isolate(ctx, seqs)
    singles = [ctx.place([i]) for i in alone]
    if not rest:
        return singles if m is None or m == len(singles) else None
    if m is not None:
        split = _split_rank(ctx, rest, m - len(alone)) if m > len(alone) else None
        return None if split is None else split + singles
    cap = ctx.bucket_size * ctx.cp_size
    m = max(1, -(-sum(int(ctx.lengths[i]) for i in rest) // cap))
    return _fewest_split(ctx, rest, m) + singles


def _fewest_split(ctx: GdsContext, rest, m: int) -> list[Placement]:
    """The interleaved split of ``rest`` with a locally fewest micro-batch count.

    From the token bound ``m`` one count at a time for :data:`LINEAR_COUNTS` counts (an
    infeasible count is usually rejected cheaply and the answer is near the bound), then
    galloping (steps 2, 4, 8, ..., capped at one sample per micro-batch, which is always
    feasible) to the first feasible count and a binary search between it and the last
    infeasible one: ``O(log M)`` DACP passes where a tight bucket needs thousands of
    micro-batches.  The result is feasible at ``m`` and infeasible at ``m - 1`` (or ``m``
    is the token bound).  The search only decides feasibility; the micro-batches are
    placed (every candidate, the fastest kept) once, at the count it found.
    """
    lo, step, tries = m - 1, 1, 0
    while _split_rank(ctx, rest, m, check_only=True) is None:
        if m >= len(rest):
            raise AssertionError("one sample per micro-batch must be feasible")
        tries += 1
        if tries > LINEAR_COUNTS:
            step *= 2
        lo, m = m, min(m + step, len(rest))
    while m - lo > 1:
        mid = (lo + m) // 2
        if _split_rank(ctx, rest, mid, check_only=True) is None:
            lo = mid
        else:
            m = mid
    return _split_rank(ctx, rest, m)


def gds_schedule(lengths, costs, comm, latency: float, dp_size: int, cp_size: int,
                 bucket_size: int, rollback: str = "auto", overhead: float = 0.0,
                 variant: str = "auto", shares=None, objective: str = "paper"
                 ) -> list[list[Placement]]:
    """GDS (docs/design.md section 4): split a global batch over DP ranks and micro-batches.

    Returns ``dp_size`` lists of equally many placements (empty placements pad ranks that
    need fewer micro-batches).  Every sample must already be known to fit alone
    (``shard_tokens(S, N) <= C``); the caller validates that.
    """
    ctx = GdsContext(lengths, costs, comm, latency, cp_size, bucket_size, rollback, variant, shares,
                objective)
    bins = lpt_partition(costs, range(len(lengths)), dp_size)
    sorted_bins = [sorted(seqs, key=lambda i: (int(lengths[i]), i)) for seqs in bins]
    splits = [_plan_rank(ctx, seqs) if seqs else [] for seqs in sorted_bins]
    m_max = max(len(s) for s in splits)
    for d, seqs in enumerate(sorted_bins):
        if seqs and len(splits[d]) < m_max:
            # (ours) Re-split into m_max micro-batches when that lowers this rank's time.
            alt = _plan_rank(ctx, seqs, m_max)
            if alt is not None and ctx.split_time(alt, overhead) < ctx.split_time(splits[d], overhead):
                splits[d] = alt
        while len(splits[d]) < m_max:
            splits[d].append(([], [[] for _ in range(cp_size)]))
    return splits
