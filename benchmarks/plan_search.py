"""The stronger search of ``plan_quality.py``: large-neighbourhood search over plans.

Warm-started from a plan (Skrull's), under a time limit, judged by the cost model
(``predict()``), over plans of local and fully distributed samples (what DACP places):

1. **ruin and recreate** (most of the time): remove a set of samples -- some of the slowest
   DP rank's (at random, or a whole micro-batch of it, or its distributed ones) and a few
   of the others' -- and re-insert them costliest first, each where it raises its DP
   rank's time the least among the positions that keep that rank under a target (the best
   makespan so far, lowered at random by up to 1%), else where its rank's time ends lowest:
   distributed or whole on the least-loaded CP rank with room (the best local choice, see
   ``refine.best_insert``) of any micro-batch of any DP rank, or of a new one.  Accepted by
   simulated annealing on the makespan (plus 1e-3 x the mean DP rank time, so moves that
   unload the other ranks count), the temperature falling from 0.2% to 0.001% of it;
2. **MILP repair** (the rest, from the best plan): :mod:`plan_milp` re-places a handful of
   samples of a few micro-batches exactly (HiGHS through scipy).

Returns the best plan found (validated, predicted by ``predict()``); never the input's
time or worse.  Deterministic for a seed up to the time limit (how far it gets).
"""
from __future__ import annotations

import math
import random
import time
from typing import Optional

import numpy as np

from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.scheduler.pricing import predict
from skrull_ext.sharding import shard_tokens_array

# Share of the time limit spent by ruin and recreate; the rest by MILP repairs.
RUIN_SHARE = 0.7
# Samples removed per ruin: from MIN_RUIN up to MAX_RUIN.
MIN_RUIN, MAX_RUIN = 3, 40


class _State:
    """A plan as lists (``dist``, ``local[r]`` per micro-batch) with cached sums."""

    def __init__(self, plan: Plan, cost_model):
        arr = np.asarray(plan.lengths, dtype=np.int64)
        n = plan.cp_size
        costs, comm, shares = cost_model.schedule_arrays(arr, n)
        self.n, self.cap, self.obj = n, plan.bucket_size, cost_model.objective
        self.lat, self.ovh = cost_model.comm_latency(n), cost_model.micro_batch_overhead
        self.len = arr.tolist()
        self.shard = shard_tokens_array(arr, n).tolist()
        self.cost, self.comm, self.share = costs.tolist(), comm.tolist(), shares.tolist()
        self.ranks = [[self._mb(list(mb.distributed), [list(r) for r in mb.local])
                       for mb in rank if not mb.is_empty()] for rank in plan.dp_ranks]
        self.rt = [sum(mb["t"] for mb in rank) for rank in self.ranks]

    def _mb(self, dist, local) -> dict:
        mb = {"dist": dist, "local": local}
        self._sums(mb)
        return mb

    def _sums(self, mb) -> None:
        dtok = sum(self.shard[i] for i in mb["dist"])
        mb["C"] = sum(self.comm[i] for i in mb["dist"])
        mb["D"] = sum(self.share[i] for i in mb["dist"])
        mb["load"] = [sum(self.cost[i] for i in r) for r in mb["local"]]
        mb["tok"] = [dtok + sum(self.len[i] for i in r) for r in mb["local"]]
        busy = bool(mb["dist"]) or any(mb["local"])
        mb["t"] = self.time(mb["C"], mb["D"], max(mb["load"]), bool(mb["dist"])) + (
            self.ovh if busy else 0.0)

    def time(self, c: float, d: float, x: float, ring: bool) -> float:
        """``reference.rank_time`` of the most loaded CP rank (no overhead)."""
        if not ring:
            return x
        c += self.lat
        n = self.n
        if self.obj == "paper" or n < 2:
            return max(c, x) + d
        b, e = d / n, c / (n - 1)
        return max(x + b, e) + b + (n - 2) * max(b, e)

    def insert_cost(self, mb, i: int):
        """``(new time, where)`` of ``mb`` plus sample ``i`` at its best place (``where``
        -1: distributed, else the CP rank), or ``None`` when it does not fit."""
        best = None
        x = max(mb["load"])
        if max(mb["tok"]) + self.shard[i] <= self.cap:
            t = self.time(mb["C"] + self.comm[i], mb["D"] + self.share[i], x, True)
            best = (t, -1)
        r, load, s = -1, mb["load"], self.len[i]
        for j, tok in enumerate(mb["tok"]):
            if tok + s <= self.cap and (r < 0 or load[j] < load[r]):
                r = j
        if r >= 0:
            t = self.time(mb["C"], mb["D"], max(x, load[r] + self.cost[i]), bool(mb["dist"]))
            if best is None or t < best[0]:
                best = (t, r)
        if best is None:
            return None
        return best[0] + self.ovh, best[1]

    def copy(self) -> "_State":
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.ranks = [[{**mb, "dist": list(mb["dist"]), "local": [list(r) for r in mb["local"]],
                       "load": list(mb["load"]), "tok": list(mb["tok"])} for mb in rank]
                     for rank in self.ranks]
        out.rt = list(self.rt)
        return out

    def makespan(self) -> float:
        return max(self.rt)

    def score(self) -> float:
        return max(self.rt) + 1e-3 * sum(self.rt) / len(self.rt)

    def remove(self, picks) -> list[int]:
        """Removes ``(d, j, i)`` samples; returns their ids."""
        touched = set()
        for d, j, i in picks:
            mb = self.ranks[d][j]
            if i in mb["dist"]:
                mb["dist"].remove(i)
            else:
                for r in mb["local"]:
                    if i in r:
                        r.remove(i)
                        break
            touched.add((d, j))
        for d, j in touched:
            self._sums(self.ranks[d][j])
        for d in {d for d, _ in touched}:
            self.ranks[d] = [mb for mb in self.ranks[d] if mb["dist"] or any(mb["local"])]
            self.rt[d] = sum(mb["t"] for mb in self.ranks[d])
        return [i for _, _, i in picks]

    def place(self, i: int, target: float, rng: random.Random) -> bool:
        """Inserts ``i`` at the best position (see the module docstring); ``False`` when
        no micro-batch, new ones included, can hold it."""
        best, best_key = None, None
        empty = self._mb([], [[] for _ in range(self.n)])
        for d, rank in enumerate(self.ranks):
            for j, mb in enumerate(rank + [empty]):
                got = self.insert_cost(mb, i)
                if got is None:
                    continue
                delta = got[0] - mb["t"]
                new_rt = self.rt[d] + delta
                key = (max(new_rt, target) + 1e-3 * delta) * (1.0 + 1e-4 * rng.random())
                if best_key is None or key < best_key:
                    best, best_key = (d, j, got[1]), key
        if best is None:
            return False
        d, j, where = best
        if j == len(self.ranks[d]):
            self.ranks[d].append(self._mb([], [[] for _ in range(self.n)]))
        mb = self.ranks[d][j]
        (mb["dist"] if where < 0 else mb["local"][where]).append(i)
        self._sums(mb)
        self.rt[d] = sum(m["t"] for m in self.ranks[d])
        return True

    def to_plan(self, plan: Plan) -> Plan:
        m = max(1, max(len(r) for r in self.ranks))
        ranks = tuple(tuple([MicroBatch(tuple(mb["dist"]), tuple(map(tuple, mb["local"])))
                             for mb in rank] + [MicroBatch.empty(self.n)] * (m - len(rank)))
                      for rank in self.ranks)
        return Plan(lengths=plan.lengths, dp_size=plan.dp_size, cp_size=self.n,
                    bucket_size=plan.bucket_size, policy="search", dp_ranks=ranks)


def _ruin(state: _State, rng: random.Random) -> list[tuple[int, int, int]]:
    """Which ``(d, j, i)`` samples to remove (see the module docstring)."""
    rt = state.rt
    d0 = max(range(len(rt)), key=lambda d: rt[d])
    where = [(d, j, i) for d, rank in enumerate(state.ranks) for j, mb in enumerate(rank)
             for i in mb["dist"] + [i for r in mb["local"] for i in r]]
    mine = [e for e in where if e[0] == d0]
    others = [e for e in where if e[0] != d0]
    q = rng.randint(MIN_RUIN, MAX_RUIN)
    kind = rng.random()
    if kind < 0.25 and state.ranks[d0]:  # one micro-batch of the slowest rank
        j = rng.randrange(len(state.ranks[d0]))
        picks = [e for e in mine if e[1] == j]
        if len(picks) > MAX_RUIN:
            picks = rng.sample(picks, MAX_RUIN)
    elif kind < 0.45:  # the distributed samples of the slowest rank, a few locals
        picks = [e for e in mine if e[2] in state.ranks[d0][e[1]]["dist"]]
        picks = rng.sample(picks, min(len(picks), q)) + rng.sample(mine, min(len(mine), q // 4))
    else:  # at random, costlier more likely
        picks = rng.sample(mine, min(len(mine), q))
    picks += rng.sample(others, min(len(others), rng.randint(0, q // 2)))
    return list({e[2]: e for e in picks}.values())


def ruin_and_recreate(state: _State, time_limit_s: float, seed: int,
                      log: Optional[list] = None, floor: float = 0.0) -> _State:
    """Simulated annealing over ruin-and-recreate moves; the best state found, early once
    its makespan is at most ``floor`` (``log``: ``(iteration, seconds, makespan)`` of each
    new best appended)."""
    rng = random.Random(seed)
    it = 0
    best, cur = state.copy(), state
    f0 = cur.score()
    start = time.perf_counter()
    while best.makespan() > floor * (1.0 + 1e-9):
        frac = (time.perf_counter() - start) / time_limit_s
        if frac >= 1.0:
            break
        temp = f0 * 2e-3 * (1e-3 ** frac)  # 0.2% of the score down to 0.0002%
        it += 1
        trial = cur.copy()
        removed = trial.remove(_ruin(trial, rng))
        removed.sort(key=lambda i: -trial.cost[i]
                     * (1.0 + 0.3 * rng.random() * (rng.random() < 0.5)))
        target = best.makespan() * (1.0 - 0.01 * rng.random())
        if not all(trial.place(i, target, rng) for i in removed):
            continue
        delta = trial.score() - cur.score()
        if delta < 0 or rng.random() < math.exp(-delta / temp):
            cur = trial
            if (cur.makespan(), cur.score()) < (best.makespan(), best.score()):
                best = cur.copy()
                if log is not None:
                    log.append((it, time.perf_counter() - start, best.makespan()))
    return best


def search(plan: Plan, cost_model, time_limit_s: float, seed: int = 0,
           milp: bool = True, floor_s: float = 0.0) -> Plan:
    """The search of the module docstring from ``plan``; the best plan (``plan`` itself
    when nothing faster was found, or when it has sub-group rings).  It stops early once
    the plan's predicted iteration time is at most ``floor_s`` (a lower bound)."""
    if any(mb.grouped for rank in plan.dp_ranks for mb in rank) or plan.cp_size < 2:
        return plan
    floor = floor_s - cost_model.time.iteration_overhead  # in DP-rank seconds
    if plan.predicted["iteration_time"] <= floor_s * (1.0 + 1e-9):
        return plan
    state = ruin_and_recreate(_State(plan, cost_model),
                              time_limit_s * (RUIN_SHARE if milp else 1.0), seed, floor=floor)
    out = state.to_plan(plan)
    out.validate()
    out.predicted.update(predict(out, cost_model))
    best = out if out.predicted["iteration_time"] < plan.predicted["iteration_time"] else plan
    if milp and best.predicted["iteration_time"] > floor_s * (1.0 + 1e-9):
        from plan_milp import search as milp_search  # benchmarks/: scipy only here

        best = milp_search(best, cost_model, time_limit_s * (1.0 - RUIN_SHARE), seed)
    return best


__all__ = ["ruin_and_recreate", "search"]
