"""FlexSP's formulation as a baseline, solved by an MILP (Wang et al., ASPLOS'25, arXiv 2412.01523).

FlexSP splits the ``D x N`` devices of every micro-batch into sequence-parallel groups of
several power-of-two sizes and gives each group some of the micro-batch's sequences, by a
mixed-integer program: minimise the slowest group's time ``M`` subject to every sequence
in one group, each group's tokens per device within memory, group time ``sum t_g(s) +
bias <= M``, and the used groups covering the devices exactly.  Source: PKU-DAIR/
Hetu-Galvatron, branch ``flexsp`` at b4666892601f1adab345dbf07b6af2c300eb7c90
(2025-03-28), ``galvatron/flexsp_solver/solver.py`` (``solve_flexSP_bucket_seqs``,
``solve_flexSP_globalbatch``, ``get_sp_options_prune``, ``bucket_seqs``) and
``sequence_module_py.py`` (``bucketing_seqs``, ``chunk_globalbatch``), read there and
rewritten here.  As there: the micro-batch count starts at the fewest whose chunks (the
batch sorted by length, cut into consecutive chunks minimising the largest chunk's tokens)
stay under the devices' capacity and grows by one while a chunk has no solution;
sequences are bucketed (the padding-minimising DP into 16 buckets, more while the buckets'
padded tokens exceed half of tokens + capacity) and the MILP chooses per bucket how many of
its sequences each candidate group takes; candidate groups are ``W / g`` copies of each
size ``g`` (fewer below the largest needed size, FlexSP's pruning).

Differences (ours), all written down:

* Solver: SciPy's ``milp`` (HiGHS) where FlexSP calls SCIP, under ``time_limit_s`` per
  chunk (FlexSP: SCIP parameters); a chunk whose solver found no solution in time counts
  as infeasible (FlexSP only retries on infeasibility), so the count grows; after
  ``MAX_EXTRA_MICRO_BATCHES`` more, the chunk is placed all-distributed and
  :data:`LAST_SOLVE` says so.  No initial solution is given (``milp`` takes none; FlexSP
  seeds balanced ones); we add ``m_p >= m_p+1`` between copies of one size, which breaks
  symmetry without changing the optimum.
* Cost: the group time of a sequence on ``g`` ranks is our cost model's, alone on that
  ring less the ring's fixed cost (its latency and step overheads), which is the group's
  ``bias``; ``g = 1`` is the sequence whole.  FlexSP's own model (Ulysses all-to-all,
  ``alpha1 s^2 + alpha2 s`` over ``g``) is not used: its plans run on our ring attention.
* Sizes: FlexSP's released options skip ``g = 1``; we keep it (our local placement), as
  every power of two ``g`` dividing ``N`` and ``N`` itself (one ring over a DP replica):
  groups then pack into DP replicas (sizes dividing each other), each replica's at
  aligned offsets.  The used groups may leave devices idle (FlexSP: exactly all of them),
  as groups inside replicas cannot cover ``D`` replicas with fewer than ``D`` sequences;
  the optimum is never worse for it.  Memory is our bucket per CP rank with zigzag padding
  (FlexSP: ``tokens / g``), checked at each bucket's longest length.
* Chunking: the largest-chunk optimum found by a bisection with a greedy cut (FlexSP's DP
  finds the same optimum; equal-optimum cuts may differ); a chunk may fill the capacity
  exactly (FlexSP: strictly below); bucketing stops at 64 buckets.
"""
from __future__ import annotations

import numpy as np

from skrull_ext.scheduler.objective import objective_of, rank_time
from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.scheduler.megatron_packing import world_micro_batch
from skrull_ext.sharding import shard_tokens_array

TIME_LIMIT_S = 2.0
MAX_EXTRA_MICRO_BATCHES = 3
BUCKETS = 16
MAX_BUCKETS = 64
# Stats of the last flexsp() call: chunks solved (optimal or not) and placed by fallback.
LAST_SOLVE: dict = {}


def _milp():
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as exc:  # benchmark-only dependency
        raise ImportError("the flexsp baseline needs SciPy (its MILP solver): "
                          "pip install 'skrull-megatron[bench]' (or pip install scipy)") from exc
    return Bounds, LinearConstraint, milp


def group_sizes(cp_size: int) -> list[int]:
    """Every power of two dividing ``N``, and ``N``."""
    sizes, g = [], 1
    while g < cp_size and cp_size % g == 0:
        sizes.append(g)
        g *= 2
    return sizes + [cp_size]


def chunk_sorted(lengths_desc: np.ndarray, parts: int) -> list[np.ndarray]:
    """Cuts a descending array into ``parts`` consecutive chunks whose largest token sum
    is the least possible (bisection on that sum, greedy cuts)."""
    s = lengths_desc.astype(np.int64)
    lo, hi = int(s.max()), int(s.sum())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_cuts(s, mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    cuts = _greedy_cuts(s, lo)
    while len(cuts) < min(parts, s.size):  # exactly `parts` chunks, as FlexSP's DP gives
        j = max(range(len(cuts)), key=lambda c: (cuts[c].size, c))
        cuts[j:j + 1] = [cuts[j][:-1], cuts[j][-1:]]
    return cuts


def _greedy_cuts(s: np.ndarray, cap: int) -> list[np.ndarray]:
    out, start, total = [], 0, 0
    for i, x in enumerate(s.tolist()):
        if total + x > cap and i > start:
            out.append(np.arange(start, i))
            start, total = i, 0
        total += x
    out.append(np.arange(start, len(s)))
    return out


def bucketize(lengths_asc: np.ndarray, buckets: int) -> list[tuple[int, int]]:
    """``bucketing_seqs``: ``(start, end)`` ranges of an ascending array into at most
    ``buckets`` contiguous buckets minimising ``sum(max - s)`` (the padding), by DP."""
    s = lengths_asc.astype(np.float64)
    n = s.size
    b = min(buckets, n)
    prefix = np.concatenate([[0.0], np.cumsum(s)])
    cost = np.full((b + 1, n + 1), np.inf)
    cut = np.zeros((b + 1, n + 1), dtype=np.int64)
    cost[0, 0] = 0.0
    j = np.arange(n + 1)
    for k in range(1, b + 1):
        for i in range(1, n + 1):
            cand = cost[k - 1, :i] + s[i - 1] * (i - j[:i]) - (prefix[i] - prefix[:i])
            best = int(np.argmin(cand))
            cost[k, i], cut[k, i] = cand[best], best
    out, i = [], n
    for k in range(b, 0, -1):
        if i == 0:
            break
        out.append((int(cut[k, i]), i))
        i = int(cut[k, i])
    return sorted(x for x in out if x[0] < x[1])


def _buckets(s: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """``bucket_seqs``: the fewest buckets from :data:`BUCKETS` up (at most
    :data:`MAX_BUCKETS`) whose padded tokens are at most half of tokens + capacity (the
    padding only falls with more buckets: a bisection finds the same count)."""
    total = int(s.sum())

    def ok(nb):
        ranges = bucketize(s, nb)
        return 2 * sum(int(s[e - 1]) * (e - b) for b, e in ranges) <= total + capacity, ranges

    lo, hi = min(BUCKETS, s.size), min(s.size, MAX_BUCKETS)
    good, ranges = ok(lo)
    if good or lo >= hi:
        return ranges
    best = ok(hi)[1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        good, ranges = ok(mid)
        if good:
            hi, best = mid, ranges
        else:
            lo = mid
    return best


def _prices(cost_model, lengths, n_max: int, sizes):
    """Per size ``g``: ``(tokens per rank [K], seconds [K], fixed seconds)`` of every
    sample alone on ``g`` ranks (``g = 1``: whole), our cost model's composition."""
    objective = objective_of(cost_model)
    out = {}
    for g in sizes:
        if g == 1:
            out[g] = (lengths.copy(), cost_model.compute_seconds(lengths), 0.0)
            continue
        share = cost_model.share_seconds(lengths, g)
        comm = cost_model.comm_seconds(lengths, g)
        lat = cost_model.comm_latency(g)
        fixed = rank_time(0.0, lat, 0.0, g, objective)
        t = np.array([rank_time(0.0, c + lat, sh, g, objective) - fixed
                      for c, sh in zip(comm.tolist(), share.tolist())])
        out[g] = (shard_tokens_array(lengths, g), np.maximum(t, 0.0), fixed)
    return out


def _candidates(need: np.ndarray, sizes, world: int) -> list[int]:
    """``get_sp_options_prune``: ``W / g`` copies of each size, fewer below the largest
    size a sequence needs; ``need``: ``[buckets, 2]`` (least size, sequences)."""
    top = int(need[:, 0].max())
    count = int(need[need[:, 0] == top, 1].sum())  # sequences needing the largest size
    out = []
    for g in sizes:
        copies = (world - top * count) // g if g < top else world // g
        out.extend([g] * max(copies, 0))
    return out


def solve_chunk(ids, lengths, prices, sizes, world: int, bucket: int, time_limit_s: float):
    """One chunk's MILP; ``[(size, sample ids)]`` of the used groups, or ``None``."""
    Bounds, LinearConstraint, milp = _milp()
    ids = np.asarray(sorted(ids, key=lambda i: (int(lengths[i]), i)), dtype=np.int64)
    if ids.size == 1:  # one sequence: the MILP's optimum is its fastest group
        i = int(ids[0])
        g = min((g for g in sizes if prices[g][0][i] <= bucket),
                key=lambda g: (prices[g][1][i] + prices[g][2], g))
        return [(g, [i])], True
    ranges = _buckets(lengths[ids], world * bucket)
    tops = [int(ids[e - 1]) for _, e in ranges]  # each bucket's longest sample
    need = np.array([min((g for g in sizes if prices[g][0][i] <= bucket), default=0)
                     for i in tops])
    if (need == 0).any():
        return None
    counts = np.array([e - b for b, e in ranges], dtype=np.float64)
    cands = _candidates(np.stack([need, counts]).T, sizes, world)
    k, p = len(ranges), len(cands)
    nvar = k * p + p + 1
    rows, lo, hi = [], [], []

    def row(entries, low, high):
        r = np.zeros(nvar)
        for j, v in entries:
            r[j] += v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    a = lambda kk, pp: kk * p + pp  # noqa: E731
    mvar, big = k * p, k * p + p
    for kk in range(k):
        row([(a(kk, pp), 1.0) for pp in range(p)], counts[kk], counts[kk])
    for pp, g in enumerate(cands):
        tok, sec, fixed = prices[g]
        row([(a(kk, pp), float(tok[tops[kk]])) for kk in range(k)], -np.inf, bucket)
        row([(a(kk, pp), float(sec[tops[kk]])) for kk in range(k)] + [(big, -1.0)],
            -np.inf, -fixed)
        row([(a(kk, pp), 1.0) for kk in range(k)] + [(mvar + pp, -float(len(ids)))], -np.inf, 0)
        row([(a(kk, pp), 1.0) for kk in range(k)] + [(mvar + pp, -1.0)], 0, np.inf)
        if pp + 1 < p and cands[pp + 1] == g:  # symmetry: copies of a size used in order
            row([(mvar + pp, 1.0), (mvar + pp + 1, -1.0)], 0, np.inf)
    row([(mvar + pp, float(g)) for pp, g in enumerate(cands)], -np.inf, world)
    upper = np.concatenate([np.repeat(counts, p), np.ones(p), [np.inf]])
    for kk in range(k):  # a bucket never goes to a group too small for its longest
        for pp, g in enumerate(cands):
            if g < need[kk]:
                upper[a(kk, pp)] = 0.0
    c = np.zeros(nvar)
    c[big] = 1.0
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.concatenate([np.ones(k * p + p), [0]]),
               bounds=Bounds(np.zeros(nvar), upper),
               options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        return None
    take = np.rint(res.x[:k * p]).astype(np.int64).reshape(k, p)
    pools = [list(ids[b:e]) for b, e in ranges]
    groups = []
    for pp, g in enumerate(cands):
        mine = []
        for kk in range(k):
            mine += pools[kk][:take[kk, pp]]
            pools[kk] = pools[kk][take[kk, pp]:]
        if mine:
            groups.append((g, sorted(int(i) for i in mine)))
    return groups, res.status == 0


def _pack(groups, dp_size: int, cp_size: int) -> list[MicroBatch]:
    """One micro-batch per DP replica from groups ``(size, ids)`` whose sizes divide each
    other and fill the replicas (largest first, each on the first replica with room)."""
    free = [0] * dp_size
    placed: list[list] = [[] for _ in range(dp_size)]
    for g, ids in sorted(groups, key=lambda x: -x[0]):
        d = next(d for d in range(dp_size) if free[d] + g <= cp_size)
        placed[d].append((d * cp_size + free[d], g, tuple(ids)))
        free[d] += g
    return [world_micro_batch(placed[d], cp_size, d * cp_size) for d in range(dp_size)]


def flexsp(lengths, costs, dp_size, cp_size, bucket_size, *, cost_model,
           time_limit_s=None):
    """FlexSP: per micro-batch an MILP over power-of-two CP sub-groups (see the module doc);
    ``time_limit_s`` per chunk (default :data:`TIME_LIMIT_S`, read at each call)."""
    time_limit_s = TIME_LIMIT_S if time_limit_s is None else time_limit_s
    lengths = np.asarray(lengths, dtype=np.int64)
    world, sizes = dp_size * cp_size, group_sizes(cp_size)
    prices = _prices(cost_model, lengths, cp_size, sizes)
    order = np.argsort(-lengths, kind="stable")
    cap = world * bucket_size
    parts = max(1, -(-int(lengths.sum()) // cap))
    while parts < lengths.size and any(int(lengths[order[c]].sum()) > cap
                                       for c in chunk_sorted(lengths[order], parts)):
        parts += 1  # get_min_valid_microbatch_num: every chunk within the capacity
    stats = {"chunks": 0, "optimal": 0, "fallback": 0}
    for extra in range(MAX_EXTRA_MICRO_BATCHES + 1):
        chunks = [order[c] for c in chunk_sorted(lengths[order], parts + extra)]
        solved = [solve_chunk(c, lengths, prices, sizes, world, bucket_size, time_limit_s)
                  for c in chunks]
        if all(x is not None for x in solved) or extra == MAX_EXTRA_MICRO_BATCHES:
            break
    ranks: list[list] = [[] for _ in range(dp_size)]
    for chunk, got in zip(chunks, solved):
        stats["chunks"] += 1
        if got is None:  # ours: no solution in time: dealt to replicas, all-CP packs
            stats["fallback"] += 1
            shard = shard_tokens_array(lengths, cp_size)
            for d in range(dp_size):
                used = bucket_size + 1
                for i in sorted(chunk.tolist())[d::dp_size]:
                    if used + shard[i] > bucket_size:
                        ranks[d].append([])
                        used = 0
                    ranks[d][-1].append(i)
                    used += int(shard[i])
            continue
        stats["optimal"] += got[1]
        for d, mb in enumerate(_pack(got[0], dp_size, cp_size)):
            ranks[d].append(mb)
    LAST_SOLVE.clear()
    LAST_SOLVE.update(stats)
    return [[mb if isinstance(mb, MicroBatch) else
             MicroBatch(distributed=tuple(mb), local=((),) * cp_size) for mb in rank]
            for rank in ranks]


flexsp.wants_cost_model = True

__all__ = ["LAST_SOLVE", "TIME_LIMIT_S", "bucketize", "chunk_sorted", "flexsp", "group_sizes",
           "solve_chunk"]
