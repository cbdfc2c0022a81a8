"""Large-neighbourhood search over plans, repaired by an MILP (benchmark only).

The stronger search of ``benchmarks/plan_quality.py``: it starts from a plan (Skrull's),
and repeatedly *destroys* part of it -- some samples of a few micro-batches of the slowest
DP rank and of one or two others, plus one new, empty micro-batch per rank touched -- and
*repairs* it optimally: a mixed-integer program places the freed samples (distributed or
whole on one CP rank, in any of those micro-batches) minimising the slowest touched DP
rank's time, the other samples staying where they are.  A repair is kept when it lowers
the DP ranks' times (sorted, largest first) lexicographically; the search stops at its
time limit.  Every time is the cost model's (``predict()``): a micro-batch costs
``max_r rank_time(local_r, T_comm, T_dist)`` (``reference.rank_time``) plus the per
micro-batch overhead when it is not empty, a DP rank the sum of its micro-batches.

The MILP (per chosen micro-batch ``b``, CP rank ``r``, freed sample ``i``; ``y_ib`` = ``i``
distributed in ``b``, ``z_ibr`` = ``i`` whole on CP rank ``r`` of ``b``)::

    sum_b (y_ib + sum_r z_ibr) = 1                          every freed sample placed
    tok_br + sum_i shard_i y_ib + sum_i S_i z_ibr <= bucket  every CP rank within the bucket
    w_b >= y_ib,  u_b >= y_ib + sum_r z_ibr                 ring latency, overhead if used
    C_b = comm_b + sum_i comm_i y_ib + latency w_b,   D_b = dist_b + sum_i share_i y_ib
    x_br = local_br + sum_i cost_i z_ibr
    ring:  t_b >= x_br + 2 D_b / N + (N - 2) v_b,  t_b >= C_b / (N - 1) + D_b / N + (N - 2) v_b,
           v_b >= D_b / N,  v_b >= C_b / (N - 1)     (= max(x + b, c) + b + (N-2) max(b, c))
    paper: t_b >= C_b + D_b,  t_b >= x_br + D_b
    Z >= rest_d + sum_{b of d} (t_b + overhead u_b)          every DP rank touched
    minimise Z + 1e-3 sum_b (t_b + overhead u_b),   Z <= its current value

exact for the cost model's micro-batch time (every term is a maximum of linear forms and is
minimised).  scipy's HiGHS (``scipy.optimize.milp``) solves it under a time limit; scipy is
imported here only (the ``bench`` extra), never by the training path.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Optional

import numpy as np

from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.scheduler.pricing import predict
from skrull_ext.scheduler.reference import micro_batch_time
from skrull_ext.sharding import shard_tokens

# Freed samples per repair at the start; halved after a timed-out solve, grown after a
# solve that proved no improvement quickly.
START_FREE, MIN_FREE, MAX_FREE = 12, 4, 64
# Seconds one MILP may take.
SOLVE_LIMIT_S = 1.0
# Times are given to the solver in ms (its tolerances are absolute).
SCALE = 1e3


@dataclasses.dataclass
class _Batch:
    """A batch's arrays and the plan's constants (what pricing needs)."""

    lengths: np.ndarray
    costs: np.ndarray
    comm: np.ndarray
    shares: np.ndarray
    latency: float
    overhead: float
    n: int
    bucket: int
    objective: str

    def shard(self, i: int) -> int:
        return shard_tokens(int(self.lengths[i]), self.n)

    def time(self, mb) -> float:
        """Seconds of micro-batch ``mb = [dist, local]``, overhead included (0 if empty)."""
        if not mb[0] and not any(mb[1]):
            return 0.0
        return micro_batch_time((mb[0], mb[1]), self.costs, self.comm, self.latency, self.n,
                                self.shares, self.objective) + self.overhead

    def tokens(self, mb) -> list[int]:
        dist = sum(self.shard(i) for i in mb[0])
        return [dist + sum(int(self.lengths[i]) for i in r) for r in mb[1]]


class _Plan:
    """``ranks[d][j] = [dist, local]`` lists with cached micro-batch and DP-rank times."""

    def __init__(self, batch: _Batch, ranks):
        self.b = batch
        self.ranks = [[[list(mb[0]), [list(r) for r in mb[1]]] for mb in rank] for rank in ranks]
        self.mbt = [[batch.time(mb) for mb in rank] for rank in self.ranks]

    def rank_time(self, d: int) -> float:
        return float(sum(self.mbt[d]))

    def times(self) -> list[float]:
        return [self.rank_time(d) for d in range(len(self.ranks))]


def _plan_lists(plan: Plan) -> list:
    return [[[list(mb.distributed), [list(r) for r in mb.local]] for mb in rank]
            for rank in plan.dp_ranks]


def _lex_less(new: list[float], old: list[float], tol: float) -> bool:
    """Whether ``new`` (sorted descending) is lexicographically below ``old`` by > ``tol``."""
    for a, b in zip(sorted(new, reverse=True), sorted(old, reverse=True)):
        if a < b - tol:
            return True
        if a > b + tol:
            return False
    return False


def _neighbourhood(state: _Plan, rng: random.Random, free_cap: int):
    """``(ranks, slots, freed)``: the DP ranks touched, their chosen micro-batches
    ``(d, j)`` (``j = None``: a new one) and the samples to re-place."""
    times = state.times()
    d0 = max(range(len(times)), key=lambda d: (times[d], -d))
    others = [d for d in range(len(times)) if d != d0]
    ranks = [d0]
    if others:
        fastest = min(others, key=lambda d: times[d])
        ranks.append(fastest if rng.random() < 0.6 else rng.choice(others))
        if len(others) > 1 and rng.random() < 0.3:
            ranks.append(rng.choice([d for d in others if d not in ranks]))
    slots, pool = [], []
    for d in ranks:
        used = [j for j, mb in enumerate(state.ranks[d]) if mb[0] or any(mb[1])]
        by_time = sorted(used, key=lambda j: -state.mbt[d][j])
        pick = rng.randint(1, min(3, len(used))) if used else 0
        chosen = set(by_time[:1] if d == d0 and used else []) if rng.random() < 0.7 else set()
        while len(chosen) < pick:
            chosen.add(rng.choice(used))
        for j in sorted(chosen):
            slots.append((d, j))
            mb = state.ranks[d][j]
            pool += [(i, d, j, -1) for i in mb[0]]
            pool += [(i, d, j, r) for r, loc in enumerate(mb[1]) for i in loc]
        slots.append((d, None))
    if len(pool) > free_cap:  # the costliest samples first, the rest at random
        costs = state.b.costs
        pool.sort(key=lambda e: -costs[e[0]])
        head = max(1, free_cap // 3)
        pool = pool[:head] + rng.sample(pool[head:], free_cap - head)
    return ranks, slots, pool


class _Model:
    """The MILP of one repair (module docstring), as sparse rows; times in ms."""

    def __init__(self, state: _Plan, slots, pool):
        self.b, self.pool = state.b, pool
        freed = {e[0] for e in pool}
        self.fixed = []  # per slot: the micro-batch without the freed samples
        for d, j in slots:
            mb = [[], [[] for _ in range(self.b.n)]] if j is None else state.ranks[d][j]
            self.fixed.append([[i for i in mb[0] if i not in freed],
                               [[i for i in r if i not in freed] for r in mb[1]]])
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []
        self.y, self.z, self.own = {}, {}, {}  # (i, s) / (i, s, r) -> column; (i, s) -> its
        ncol = 0
        for s, mb in enumerate(self.fixed):
            tok = self.b.tokens(mb)
            for i, *_ in pool:
                mine = self.own.setdefault((i, s), [])
                if self.b.n > 1 and max(tok) + self.b.shard(i) <= self.b.bucket:
                    self.y[i, s] = ncol
                    mine.append(ncol)
                    ncol += 1
                for r in range(self.b.n):
                    if tok[r] + int(self.b.lengths[i]) <= self.b.bucket:
                        self.z[i, s, r] = ncol
                        mine.append(ncol)
                        ncol += 1
        self.nbin = ncol
        self.t_col = [ncol + 4 * s for s in range(len(slots))]  # t, v, w, u per slot
        self.z_col = ncol + 4 * len(slots)
        self.ncol = self.z_col + 1
        self.lb, self.ub = np.zeros(self.ncol), np.full(self.ncol, np.inf)
        self.ub[:ncol] = 1.0
        self.integrality = np.zeros(self.ncol)
        self.integrality[:ncol] = 1

    def row(self, entries, low: float, high: float) -> None:
        r = len(self.lo)
        for c, v in entries:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(low)
        self.hi.append(high)

    def slot(self, s: int) -> None:
        """Slot ``s``'s bucket rows, indicators and micro-batch time rows."""
        b, mb, pool = self.b, self.fixed[s], self.pool
        tc, vc, wc, uc = (self.t_col[s] + k for k in range(4))
        tok = b.tokens(mb)
        ys = [(i, self.y[i, s]) for i, *_ in pool if (i, s) in self.y]
        zs = [[(i, self.z[i, s, r]) for i, *_ in pool if (i, s, r) in self.z] for r in range(b.n)]
        for r in range(b.n):
            self.row([(c, float(b.shard(i))) for i, c in ys]
                     + [(c, float(b.lengths[i])) for i, c in zs[r]], -np.inf,
                     float(b.bucket - tok[r]))
        has_dist, busy = bool(mb[0]), bool(mb[0] or any(mb[1]))
        self.integrality[wc] = self.integrality[uc] = 1
        self.lb[wc], self.ub[wc] = (1.0, 1.0) if has_dist else (0.0, 1.0)
        self.lb[uc], self.ub[uc] = (1.0, 1.0) if busy else (0.0, 1.0)
        for _, c in ys:
            self.row([(wc, 1.0), (c, -1.0)], 0.0, np.inf)
        for i, *_ in pool:
            if self.own[i, s]:
                self.row([(uc, 1.0)] + [(c, -1.0) for c in self.own[i, s]], 0.0, np.inf)
        comm0 = SCALE * (sum(b.comm[i] for i in mb[0]) + (b.latency if has_dist else 0.0))
        dist0 = SCALE * sum(b.shares[i] for i in mb[0])
        c_terms = [(c, SCALE * b.comm[i]) for i, c in ys]  # C_b (latency: w, or in comm0)
        if not has_dist:
            c_terms.append((wc, SCALE * b.latency))
        d_terms = [(c, SCALE * b.shares[i]) for i, c in ys]
        ring, n = b.objective == "ring" and b.n >= 2, b.n
        for r in range(n):
            x0 = SCALE * sum(b.costs[i] for i in mb[1][r])
            x_terms = [(c, -SCALE * b.costs[i]) for i, c in zs[r]]
            if ring:  # t >= x + 2D/N + (N-2) v
                self.row([(tc, 1.0), (vc, -(n - 2.0))] + x_terms
                         + [(c, -2.0 * v / n) for c, v in d_terms], x0 + 2.0 * dist0 / n, np.inf)
            else:  # t >= x + D
                self.row([(tc, 1.0)] + x_terms + [(c, -v) for c, v in d_terms], x0 + dist0,
                         np.inf)
        self._symmetry(s, mb, tok, zs)
        if ring:  # t >= C/(N-1) + D/N + (N-2) v,  v >= D/N,  v >= C/(N-1)
            self.row([(tc, 1.0), (vc, -(n - 2.0))] + [(c, -v / (n - 1)) for c, v in c_terms]
                     + [(c, -v / n) for c, v in d_terms], comm0 / (n - 1) + dist0 / n, np.inf)
            self.row([(vc, 1.0)] + [(c, -v / n) for c, v in d_terms], dist0 / n, np.inf)
            self.row([(vc, 1.0)] + [(c, -v / (n - 1)) for c, v in c_terms], comm0 / (n - 1),
                     np.inf)
        else:  # t >= C + D
            self.ub[vc] = 0.0
            self.row([(tc, 1.0)] + [(c, -v) for c, v in c_terms] + [(c, -v) for c, v in d_terms],
                     comm0 + dist0, np.inf)

    def _symmetry(self, s: int, mb, tok, zs) -> None:
        """CP ranks of slot ``s`` that hold the same fixed work and tokens are
        interchangeable: their added loads are kept in rank order (one of each symmetric
        solution family survives)."""
        loads = [sum(self.b.costs[i] for i in r) for r in mb[1]]
        for r in range(1, len(mb[1])):
            if loads[r] == loads[r - 1] and tok[r] == tok[r - 1] and (zs[r] or zs[r - 1]):
                self.row([(c, SCALE * self.b.costs[i]) for i, c in zs[r - 1]]
                         + [(c, -SCALE * self.b.costs[i]) for i, c in zs[r]], 0.0, np.inf)


def _repair(state: _Plan, ranks, slots, pool, limit_s: float):
    """Solves the MILP of the module docstring: ``(where, timed_out, fixed)`` with
    ``where = {sample: (slot index, CP rank or -1)}`` (None when no solution came back)
    and ``fixed`` the chosen micro-batches without the freed samples."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # benchmark-only dependency
    from scipy.sparse import coo_matrix

    m = _Model(state, slots, pool)
    for i, *_ in pool:  # every freed sample placed once
        m.row([(c, 1.0) for s in range(len(slots)) for c in m.own[i, s]], 1.0, 1.0)
    for s in range(len(slots)):
        m.slot(s)
    before = []
    for d in ranks:  # Z >= rest_d + sum_{b of d} (t_b + overhead u_b)
        chosen = {j for dd, j in slots if dd == d and j is not None}
        rest = SCALE * sum(t for j, t in enumerate(state.mbt[d]) if j not in chosen)
        terms = [(m.z_col, 1.0)]
        for s, (dd, _) in enumerate(slots):
            if dd == d:
                terms += [(m.t_col[s], -1.0), (m.t_col[s] + 3, -SCALE * state.b.overhead)]
        m.row(terms, rest, np.inf)
        before.append(state.rank_time(d))
    objective = np.zeros(m.ncol)
    objective[m.z_col] = 1.0
    for s in range(len(slots)):
        objective[m.t_col[s]] = 1e-3
        objective[m.t_col[s] + 3] = 1e-3 * SCALE * state.b.overhead
    m.ub[m.z_col] = SCALE * max(before) * (1 + 1e-9)  # only as good or better
    a = coo_matrix((m.vals, (m.rows, m.cols)), shape=(len(m.lo), m.ncol)).tocsr()
    res = milp(objective, integrality=m.integrality, bounds=Bounds(m.lb, m.ub),
               constraints=LinearConstraint(a, m.lo, m.hi),
               options={"time_limit": max(0.05, limit_s), "mip_rel_gap": 1e-7})
    if res.x is None:
        return None, res.status == 1, m.fixed
    where = {i: (s, -1) for (i, s), c in m.y.items() if res.x[c] > 0.5}
    where.update({i: (s, r) for (i, s, r), c in m.z.items() if res.x[c] > 0.5})
    return (where if len(where) == len(pool) else None), res.status == 1, m.fixed


def _apply(state: _Plan, slots, pool, where, fixed) -> tuple[list, list]:
    """The touched DP ranks' new micro-batch lists (not yet committed) and their times."""
    new = [[list(mb[0]), [list(r) for r in mb[1]]] for mb in fixed]
    for i, *_ in sorted(pool, key=lambda e: e[0]):
        s, r = where[i]
        (new[s][0] if r < 0 else new[s][1][r]).append(i)
    return new, [state.b.time(mb) for mb in new]


def search(plan: Plan, cost_model, time_limit_s: float, seed: int = 0) -> Plan:
    """The LNS of the module docstring from ``plan`` (local and distributed placements
    only); returns the best plan found, validated and predicted (``plan`` itself when no
    repair improved it or it has sub-group rings)."""
    if any(mb.grouped for rank in plan.dp_ranks for mb in rank) or plan.cp_size < 2:
        return plan
    arr = np.asarray(plan.lengths, dtype=np.int64)
    costs, comm, shares = cost_model.schedule_arrays(arr, plan.cp_size)
    batch = _Batch(arr, costs, comm, shares, cost_model.comm_latency(plan.cp_size),
                   cost_model.micro_batch_overhead, plan.cp_size, plan.bucket_size,
                   cost_model.objective)
    state = _Plan(batch, _plan_lists(plan))
    rng = random.Random(seed)
    free_cap = START_FREE
    deadline = time.perf_counter() + time_limit_s
    tol = 1e-12 * max(state.times())
    while time.perf_counter() < deadline - 0.05:
        ranks, slots, pool = _neighbourhood(state, rng, free_cap)
        if not pool:
            break
        left = deadline - time.perf_counter()
        start = time.perf_counter()
        where, timed_out, fixed = _repair(state, ranks, slots, pool, min(SOLVE_LIMIT_S, left))
        took = time.perf_counter() - start
        if timed_out:
            free_cap = max(MIN_FREE, free_cap // 2)
        elif took < 0.2 * SOLVE_LIMIT_S:
            free_cap = min(MAX_FREE, free_cap + 2)
        if where is None:
            continue
        new, new_t = _apply(state, slots, pool, where, fixed)
        old_times = state.times()
        trial = list(old_times)
        per_rank = {d: [t for j, t in enumerate(state.mbt[d])
                        if (d, j) not in slots] for d in ranks}
        for (d, _), t in zip(slots, new_t):
            per_rank[d].append(t)
        for d in ranks:
            trial[d] = float(sum(per_rank[d]))
        if not _lex_less(trial, old_times, tol):
            continue
        _commit(state, ranks, slots, new, new_t)
    return _to_plan(plan, state, cost_model)


def _commit(state: _Plan, ranks, slots, new, new_t) -> None:
    for d in ranks:
        keep = [(mb, t) for j, (mb, t) in enumerate(zip(state.ranks[d], state.mbt[d]))
                if (d, j) not in slots]
        keep += [(mb, t) for (dd, _), mb, t in zip(slots, new, new_t) if dd == d]
        keep = [(mb, t) for mb, t in keep if mb[0] or any(mb[1])]
        state.ranks[d] = [mb for mb, _ in keep]
        state.mbt[d] = [t for _, t in keep]


def _to_plan(plan: Plan, state: _Plan, cost_model) -> Plan:
    n = plan.cp_size
    m = max(1, max(len(r) for r in state.ranks))
    ranks = tuple(tuple([MicroBatch(tuple(mb[0]), tuple(tuple(r) for r in mb[1]))
                         for mb in rank] + [MicroBatch.empty(n)] * (m - len(rank)))
                  for rank in state.ranks)
    out = Plan(lengths=plan.lengths, dp_size=plan.dp_size, cp_size=n,
               bucket_size=plan.bucket_size, policy="lns", dp_ranks=ranks)
    out.validate()
    out.predicted.update(predict(out, cost_model))
    if out.predicted["iteration_time"] >= plan.predicted["iteration_time"]:
        return plan
    return out


__all__ = ["search"]
