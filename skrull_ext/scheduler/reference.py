"""Pure-Python reference of the Skrull scheduler: the readable specification.

Implements SKRULL.md sections 3 (DACP) and 4 (GDS) on plain arrays.  The C++ core
(``csrc/``) mirrors every function here step for step and must return identical plans;
``tests/test_parity.py`` checks that.  Rules both implementations follow so they agree
bit for bit:

* Inputs are ``lengths`` (int64), ``costs`` (float64 compute seconds of a whole sequence),
  optional ``shares`` (float64 compute seconds each CP rank spends on a distributed
  sequence; ``costs[i] / N`` when omitted), ``comm`` (float64 ring bandwidth seconds of a
  distributed sequence) and ``latency``
  (ring seconds paid once by a micro-batch with any distributed sequence), precomputed by
  :class:`skrull_ext.cost.CostModel`; the core never evaluates a cost function itself.
* Float accumulations happen in the same order in both (C++ is built without FMA
  contraction), and every tie is broken by the lowest rank / sample index.

Placements are lists: ``distributed`` sample ids in placement order and ``local[r]`` the
ids held whole by CP rank ``r`` in placement order.
"""
from __future__ import annotations

import heapq
from typing import Optional, Sequence

from skrull_ext.plan import shard_tokens

ROLLBACK_POLICIES = ("shortest", "best-fit", "auto")
DACP_VARIANTS = ("paper", "balanced", "lpt", "auto")

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


def dacp_place(lengths, costs, idx: Sequence[int], cp_size: int, bucket_size: int,
               rollback: str = "shortest", shares=None) -> Optional[Placement]:
    """DACP (SKRULL.md section 3) for one micro-batch on one CP group.

    Args:
        lengths: ``[K]`` token lengths of the global batch.
        costs: ``[K]`` compute seconds of each whole sequence.
        idx: Sample ids of this micro-batch.
        cp_size: CP ranks ``N``.
        bucket_size: Token budget ``C`` of each rank.
        rollback: ``shortest`` or ``best-fit`` victim choice.
        shares: ``[K]`` per-rank seconds of a distributed sequence (default ``costs / N``).

    Returns:
        ``(distributed, local)`` or ``None`` when the micro-batch is infeasible.
    """
    n = cp_size
    order = sorted(idx, key=lambda i: (int(lengths[i]), i))
    rem = [int(bucket_size)] * n
    load = [0.0] * n
    local: list[list[int]] = [[] for _ in range(n)]
    dist: list[int] = []
    for i in order:
        s = int(lengths[i])
        while True:
            r = _argmin(load)
            if rem[r] < s:
                r = _argmax(rem)
            if rem[r] >= s:
                local[r].append(i)
                rem[r] -= s
                load[r] += costs[i]
                break
            sh = shard_tokens(s, n)
            if min(rem) >= sh:
                dist.append(i)
                for j in range(n):
                    rem[j] -= sh
                    load[j] += _share(costs, shares, i, n)
                break
            # Roll back: demote a local sequence of the fullest rank to distributed.
            r = _argmin(rem)
            if n == 1 or not local[r]:
                return None  # with one rank a demotion frees nothing
            p = _choose_victim(local[r], lengths, rem, r, s, n, rollback)
            v = local[r][p]
            lv = int(lengths[v])
            sv = shard_tokens(lv, n)
            if rem[r] + lv < sv or any(rem[j] < sv for j in range(n) if j != r):
                return None  # the demoted sequence itself would overflow a rank
            del local[r][p]
            rem[r] += lv
            load[r] -= costs[v]
            for j in range(n):
                rem[j] -= sv
                load[j] += _share(costs, shares, v, n)
            dist.append(v)
    return dist, local


def micro_batch_time(placement: Placement, costs, comm, latency: float, cp_size: int,
                     shares=None) -> float:
    """Predicted seconds of one placed micro-batch (SKRULL.md section 3 objective).

    ``max_j( max(T_comm(distributed), T_comp(local_j)) + T_comp(distributed) / N )``; the
    caller adds the fixed per-micro-batch overhead.
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
        t = max(t_comm, t_local) + t_dist
        if t > worst:
            worst = t
    return worst


def _objective(local_load, t_comm: float, t_dist: float, r: int = -1, extra: float = 0.0
               ) -> float:
    """``max_j(max(t_comm, local_j) + t_dist)`` with ``extra`` added to rank ``r``'s local load."""
    worst = 0.0
    for j, x in enumerate(local_load):
        if j == r:
            x = x + extra
        t = max(t_comm, x) + t_dist
        if t > worst:
            worst = t
    return worst


def dacp_place_balanced(lengths, costs, comm, latency: float, idx: Sequence[int], cp_size: int,
                        bucket_size: int, rollback: str = "shortest", shares=None
                        ) -> Optional[Placement]:
    """(ours) DACP that distributes a sequence when that lowers the micro-batch objective.

    The paper's step a keeps every sequence that fits local, so the longest sequences of a
    micro-batch land whole on one rank and its compute dominates.  Here step a compares
    the objective of :func:`micro_batch_time` after placing the sequence local on the
    least-loaded rank with the objective after distributing it, and distributes when that
    is strictly lower (and every rank has room for its shard).  Order, memory steps b-c
    and the roll-back are the paper's.  Returns ``None`` when infeasible.
    """
    n = cp_size
    order = sorted(idx, key=lambda i: (int(lengths[i]), i))
    rem = [int(bucket_size)] * n
    local_load = [0.0] * n
    comm_sum = 0.0
    dist_load = 0.0
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
                if can_dist:
                    t_comm = comm_sum + latency if dist else 0.0
                    keep = _objective(local_load, t_comm, dist_load, r, costs[i])
                    move = _objective(local_load, comm_sum + comm[i] + latency,
                                      dist_load + _share(costs, shares, i, n))
                    can_dist = move < keep
                if not can_dist:
                    local[r].append(i)
                    rem[r] -= s
                    local_load[r] += costs[i]
                    break
            if can_dist:
                dist.append(i)
                for j in range(n):
                    rem[j] -= sh
                comm_sum += comm[i]
                dist_load += _share(costs, shares, i, n)
                break
            r = _argmin(rem)
            if n == 1 or not local[r]:
                return None
            p = _choose_victim(local[r], lengths, rem, r, s, n, rollback)
            v = local[r][p]
            lv = int(lengths[v])
            sv = shard_tokens(lv, n)
            if rem[r] + lv < sv or any(rem[j] < sv for j in range(n) if j != r):
                return None
            del local[r][p]
            rem[r] += lv
            local_load[r] -= costs[v]
            for j in range(n):
                rem[j] -= sv
            comm_sum += comm[v]
            dist_load += _share(costs, shares, v, n)
            dist.append(v)
    return dist, local


def _lpt_local(rest: Sequence[int], lengths, costs, n: int, cap: int
               ) -> Optional[list[list[int]]]:
    """Each of ``rest`` (in order) to the least-loaded rank with room; ``None`` if none has."""
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
    return local


def dacp_place_lpt(lengths, costs, comm, latency: float, idx: Sequence[int], cp_size: int,
                   bucket_size: int, shares=None) -> Optional[Placement]:
    """(ours) Distribute the ``k`` longest sequences, pack the rest local by LPT; best ``k``.

    The paper's step a (and the balanced variant) place sequences shortest first, one at a
    time, so local sequences cannot be balanced against each other: the balanced variant
    then distributes short sequences merely to even out the ranks.  Here, for
    ``k = 0, 1, ...`` the ``k`` longest sequences (ties: lower index first) are distributed
    and the others go longest first to the least-loaded rank with room (ties: lowest
    rank); the ``k`` with the lowest :func:`micro_batch_time` wins (ties: smaller ``k``).
    The search stops once the distributed part alone, ``T_comm + T_dist``, reaches the best
    time (both only grow with ``k``) or the shards overflow the bucket, and skips a ``k``
    whose bound ``max(T_comm, rest / N) + T_dist`` cannot beat the best.  ``None`` when no
    ``k`` is feasible.
    """
    n = cp_size
    order = sorted(idx, key=lambda i: (-int(lengths[i]), i))
    suffix = [0.0] * (len(order) + 1)
    for p in range(len(order) - 1, -1, -1):
        suffix[p] = suffix[p + 1] + costs[order[p]]
    best, best_t = None, 0.0
    shard_sum, comm_sum, dist_load = 0, 0.0, 0.0
    for k in range(len(order) + 1):
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
        if best is not None:
            if t_comm + dist_load >= best_t:
                break
            if max(t_comm, suffix[k] / n) + dist_load >= best_t:
                continue
        local = _lpt_local(order[k:], lengths, costs, n, int(bucket_size) - shard_sum)
        if local is None:
            continue
        cand = (list(order[:k]), local)
        t = micro_batch_time(cand, costs, comm, latency, n, shares)
        if best is None or t < best_t:
            best, best_t = cand, t
    return best


def dacp_best(lengths, costs, comm, latency, idx, cp_size, bucket_size, rollback,
              variant: str = "paper", shares=None):
    """DACP with the chosen roll-back and variant; ``auto`` tries each, keeps the fastest.

    Candidates in order (ties keep the earlier): paper/shortest, paper/best-fit,
    balanced/shortest, balanced/best-fit, lpt (no roll-back), restricted to the requested
    settings.
    """
    rollbacks = ("shortest", "best-fit") if rollback == "auto" else (rollback,)
    variants = ("paper", "balanced", "lpt") if variant == "auto" else (variant,)
    best, best_t = None, 0.0
    for var in variants:
        for rb in rollbacks if var != "lpt" else ("none",):
            if var == "paper":
                cand = dacp_place(lengths, costs, idx, cp_size, bucket_size, rb, shares)
            elif var == "lpt":
                cand = dacp_place_lpt(lengths, costs, comm, latency, idx, cp_size, bucket_size,
                                      shares)
            else:
                cand = dacp_place_balanced(lengths, costs, comm, latency, idx, cp_size,
                                           bucket_size, rb, shares)
            if cand is None:
                continue
            t = micro_batch_time(cand, costs, comm, latency, cp_size, shares)
            if best is None or t < best_t:
                best, best_t = cand, t
    return best


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


def _split_rank(lengths, costs, comm, latency, seqs, m, cp_size, bucket_size, rollback,
                variant, shares):
    """Interleave into ``m`` micro-batches and place each; ``None`` if any is infeasible."""
    cap = bucket_size * cp_size
    groups = interleave(seqs, m)
    out = []
    for g in groups:
        if sum(int(lengths[i]) for i in g) > cap:
            return None
        placed = dacp_best(lengths, costs, comm, latency, g, cp_size, bucket_size, rollback,
                           variant, shares)
        if placed is None:
            return None
        out.append(placed)
    return out


def _rank_time(split, costs, comm, latency, cp_size, overhead, shares) -> float:
    t = 0.0
    for placement in split:
        if placement[0] or any(placement[1]):
            t += micro_batch_time(placement, costs, comm, latency, cp_size, shares) + overhead
    return t


def gds_schedule(lengths, costs, comm, latency: float, dp_size: int, cp_size: int,
                 bucket_size: int, rollback: str = "auto", overhead: float = 0.0,
                 variant: str = "auto", shares=None) -> list[list[Placement]]:
    """GDS (SKRULL.md section 4): split a global batch over DP ranks and micro-batches.

    Returns ``dp_size`` lists of equally many placements (empty placements pad ranks that
    need fewer micro-batches).  Every sample must already be known to fit alone
    (``shard_tokens(S, N) <= C``); the caller validates that.
    """
    cap = bucket_size * cp_size
    bins = lpt_partition(costs, range(len(lengths)), dp_size)
    splits: list[list[Placement]] = []
    sorted_bins = []
    for seqs in bins:
        seqs = sorted(seqs, key=lambda i: (int(lengths[i]), i))
        sorted_bins.append(seqs)
        if not seqs:
            splits.append([])
            continue
        total = sum(int(lengths[i]) for i in seqs)
        m = max(1, -(-total // cap))
        while True:
            split = _split_rank(lengths, costs, comm, latency, seqs, m, cp_size, bucket_size,
                                rollback, variant, shares)
            if split is not None:
                break
            if m >= len(seqs):
                raise AssertionError("one sample per micro-batch must be feasible")
            m += 1
        splits.append(split)
    m_max = max(len(s) for s in splits)
    for d, seqs in enumerate(sorted_bins):
        if seqs and len(splits[d]) < m_max:
            # (ours) Re-split into m_max micro-batches when that lowers this rank's time.
            alt = _split_rank(lengths, costs, comm, latency, seqs, m_max, cp_size, bucket_size,
                              rollback, variant, shares)
            if alt is not None and (
                    _rank_time(alt, costs, comm, latency, cp_size, overhead, shares)
                    < _rank_time(splits[d], costs, comm, latency, cp_size, overhead, shares)):
                splits[d] = alt
        while len(splits[d]) < m_max:
            splits[d].append(([], [[] for _ in range(cp_size)]))
    return splits
