"""(ours) Local search refinement of a scheduled plan under the true iteration-time objective.

The portfolio (:mod:`skrull_ext.scheduler.portfolio`) builds whole plans; this pass then
improves the picked one by small moves, each re-priced with the exact prediction
(:func:`~skrull_ext.scheduler.reference.micro_batch_time` per micro-batch, a DP rank's
time the sum over its micro-batches plus the per-micro-batch overhead, as
``GdsContext.split_time``; the iteration time is the slowest DP rank's).

Moves, all from the slowest DP rank ``d`` (ties: the lowest index):

* **relocate** a sample of one of ``d``'s micro-batches (most expensive micro-batch first,
  samples distributed first, then CP rank by rank, in placement order) into a target
  micro-batch, placed by :func:`best_insert` (distributed, or whole on the CP rank with the
  least local work among those with room: the best local choice, since every rank's time
  is the same non-decreasing function of its local work).  Targets, in order: the same
  micro-batch (a local/distributed or CP-rank **flip**), the :data:`TARGETS` fastest
  micro-batches of the fastest DP rank (a **move** between DP ranks; an empty micro-batch
  there makes a new one), then the :data:`TARGETS` fastest other micro-batches of ``d``
  (a move between micro-batches, or a **split** into an empty one);
* **swap** the sample with a cheaper one of a target micro-batch on the fastest rank, each
  placed by :func:`best_insert` in the other's micro-batch;
* **merge** two of ``d``'s :data:`TARGETS` fastest non-empty micro-batches into one,
  placed by :func:`~skrull_ext.scheduler.portfolio.place_group` (DACP).

A move is accepted (first improvement, then the search restarts from the new slowest
rank) only when the largest time among the DP ranks it touches falls strictly below
``d``'s: the iteration time never rises and the sorted vector of DP-rank times falls
lexicographically, so the search ends.  It stops when ``d`` has no improving move or when
the work budget is spent.  Every candidate keeps each CP rank within the bucket; empty
micro-batches are moved to the end of each rank and all-empty trailing ones dropped.

**Budget.**  The search counts work, not wall time, so the plan is the same on every
rank and every run for a given budget: pricing a micro-batch of ``s`` samples costs
``s + N`` units, a DP rank's time or its fastest micro-batches its micro-batch count, a DACP placement
:data:`PLACE_WORK_FACTOR` ``x (s + N)``.  It stops before the first evaluation that
starts with the count at or above the budget.  ``budget_ms`` converts with
:data:`WORK_UNITS_PER_MS`, measured for the C++ core (``benchmarks/bench_scheduler.py
--calibrate``).

This module is the specification; ``csrc/refine.cpp`` mirrors it step for step
(``tests/test_refine.py`` checks identical plans).
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from skrull_ext.sharding import shard_tokens
from skrull_ext.scheduler.reference import GdsContext, Placement, micro_batch_time

# Micro-batches tried per receiving DP rank (the fastest ones) by relocate, swap and merge.
TARGETS = 4
# Work units per ms of the C++ core's search (`benchmarks/bench_scheduler.py --calibrate`
# on the 2-vCPU dev machine: median 223K, 134-481K across K = 1,024-65,536 and buckets
# 2K-26K; the one-off pricing of the plan before the search, 0.1-2 ms, is not counted);
# the Python reference is ~100x slower per unit.
WORK_UNITS_PER_MS = 225_000
# Default --skrull-plan-budget-ms: keeps schedule() within the latency targets.
DEFAULT_BUDGET_MS = 1.0
# The budget applies up to this many samples and grows with the square of K beyond, at
# most this factor (budget_work): 4 ms by default at K = 512, 16 ms from K = 1,024 on.
# Squared because both the steps a search needs and each step's cost grow with K (issue
# 31's grid: at GBS 1,024, 4 ms left plans up to 1.8% slower than a 300-ms search's, 16 ms
# at most 0.8% in 4 of those 5 settings); plan-ahead hides the milliseconds in training.
BUDGET_SCALE_K, BUDGET_SCALE_MAX = 256, 16
# A DACP placement (dacp_best, auto: five candidates) costs this many pricings.
PLACE_WORK_FACTOR = 8


def all_distributed(ctx: GdsContext, group: Sequence[int]) -> Optional[Placement]:
    """Every sample of ``group`` distributed, in the given order; ``None`` if it overflows."""
    if sum(shard_tokens(int(ctx.lengths[i]), ctx.cp_size) for i in group) > ctx.bucket_size:
        return None
    return list(group), [[] for _ in range(ctx.cp_size)]


def place_group(ctx: GdsContext, group: Sequence[int]) -> Optional[Placement]:
    """DACP of one micro-batch, or all-distributed in ``group`` order when strictly faster."""
    placed = ctx.place(group)
    alt = all_distributed(ctx, group)
    if alt is None:
        return placed
    if placed is None or (placement_time(ctx, alt) < placement_time(ctx, placed)):
        return alt
    return placed


def placement_time(ctx: GdsContext, placement: Placement) -> float:
    """:func:`micro_batch_time` of ``placement`` on ``ctx``'s arrays (no overhead)."""
    return micro_batch_time(placement, ctx.costs, ctx.comm, ctx.latency, ctx.cp_size,
                            ctx.shares, ctx.objective)


def budget_ms_arg(text: str) -> float:
    """argparse type of ``--skrull-plan-budget-ms`` / ``--plan-budget-ms``: ms in [0, 1e6)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of ms {text!r}") from None
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r} is outside [0, 1e6) ms (0: no refinement)")
    return value


def budget_work(budget_ms: float, k: int = BUDGET_SCALE_K) -> int:
    """Work units of a ``budget_ms`` budget for a batch of ``k`` samples (0 disables
    refinement): ``budget_ms`` up to :data:`BUDGET_SCALE_K` samples, growing with
    ``(k / BUDGET_SCALE_K) ** 2`` up to :data:`BUDGET_SCALE_MAX` times (larger batches
    gain more from a search than its milliseconds cost, and plan-ahead hides them)."""
    ratio = max(1.0, k / BUDGET_SCALE_K)
    scale = min(float(BUDGET_SCALE_MAX), ratio * ratio)
    return max(0, int(round(float(budget_ms) * scale * WORK_UNITS_PER_MS)))


def _empty(p: Placement) -> bool:
    return not p[0] and not any(p[1])


def _size(p: Placement) -> int:
    return len(p[0]) + sum(len(r) for r in p[1])


def _samples(p: Placement) -> list[tuple[int, int]]:
    """``(sample, where)`` of a placement: ``where`` -1 distributed, else the CP rank."""
    return [(i, -1) for i in p[0]] + [(i, r) for r, rank in enumerate(p[1]) for i in rank]


def _without(p: Placement, i: int, where: int) -> Placement:
    if where < 0:
        return [x for x in p[0] if x != i], p[1]
    return p[0], [[x for x in rank if x != i] if r == where else rank
                  for r, rank in enumerate(p[1])]


class _Search:
    """The plan being refined, its cached times and the work counter."""

    def __init__(self, ctx: GdsContext, splits, overhead: float, budget: int):
        self.ctx, self.overhead, self.budget, self.work = ctx, overhead, budget, 0
        self.splits = [list(s) + [([], [[] for _ in range(ctx.cp_size)])] for s in splits]
        self.mbt = [[self.price(p) for p in s] for s in self.splits]
        self.rt = [self.rank_time(d) for d in range(len(self.splits))]
        self.work = 0
        self.fast_d: list[int] = []  # step(): d's TARGETS + 1 fastest micro-batches
        self.fast_d2: list[int] = []  # the fastest rank's TARGETS fastest
        self.full_d2: list[int] = []  # ... non-empty ones

    def spent(self) -> bool:
        return self.work >= self.budget

    def price(self, p: Placement) -> float:
        c = self.ctx
        self.work += _size(p) + c.cp_size
        return micro_batch_time(p, c.costs, c.comm, c.latency, c.cp_size, c.shares, c.objective)

    def rank_time(self, d: int, repl: Optional[dict] = None) -> float:
        """``split_time`` of DP rank ``d`` from cached times; ``repl``: ``{j: (p, t)}``."""
        t = 0.0
        self.work += len(self.splits[d])
        for j, p in enumerate(self.splits[d]):
            mt = self.mbt[d][j]
            if repl is not None and j in repl:
                p, mt = repl[j]
            if not _empty(p):
                t += mt + self.overhead
        return t

    def tokens(self, p: Placement) -> list[int]:
        lengths, n = self.ctx.lengths, self.ctx.cp_size
        dist = sum(shard_tokens(int(lengths[i]), n) for i in p[0])
        return [dist + sum(int(lengths[i]) for i in rank) for rank in p[1]]

    def best_insert(self, p: Placement, i: int):
        """``(placement, time)`` of ``p`` plus sample ``i``, distributed or local on the
        least-loaded CP rank with room, whichever is faster (ties: distributed);
        ``None`` when neither fits the bucket."""
        c = self.ctx
        s, n, cap = int(c.lengths[i]), c.cp_size, c.bucket_size
        tok = self.tokens(p)
        best = None
        if n > 1 and max(tok) + shard_tokens(s, n) <= cap:
            cand = (p[0] + [i], p[1])
            best = (cand, self.price(cand))
        r = -1
        loads = [sum(c.costs[x] for x in rank) for rank in p[1]]
        for j in range(n):
            if tok[j] + s <= cap and (r < 0 or loads[j] < loads[r]):
                r = j
        if r >= 0:
            cand = (p[0], [rank + [i] if j == r else rank for j, rank in enumerate(p[1])])
            t = self.price(cand)
            if best is None or t < best[1]:
                best = (cand, t)
        return best

    def fastest(self, d: int, count: int = TARGETS, nonempty: bool = False) -> list[int]:
        """Up to ``count`` micro-batches of rank ``d`` by ascending (time, index)."""
        self.work += len(self.splits[d])
        order = sorted((self.mbt[d][j], j) for j, p in enumerate(self.splits[d])
                       if not (nonempty and _empty(p)))
        return [j for _, j in order[:count]]

    def apply(self, changes: list[tuple[int, int, Placement, float]]) -> None:
        """Commits ``(d, j, placement, time)`` changes; keeps an empty micro-batch per rank."""
        for d, j, p, t in changes:
            self.splits[d][j], self.mbt[d][j] = p, t
        for d in sorted({ch[0] for ch in changes}):
            if not any(_empty(p) for p in self.splits[d]):
                self.splits[d].append(([], [[] for _ in range(self.ctx.cp_size)]))
                self.mbt[d].append(0.0)
            self.rt[d] = self.rank_time(d)

    def relocate(self, d: int, j: int, i: int, where: int, d2: int) -> bool:
        """Moves sample ``i`` of micro-batch ``(d, j)`` to the first improving target."""
        src = _without(self.splits[d][j], i, where)
        targets = [(d, j)] + [(d2, k) for k in self.fast_d2]
        targets += [(d, k) for k in self.fast_d if k != j][:TARGETS]
        src_t = src_rt = None
        for e, k in targets:
            if self.spent():
                return False
            if (e, k) == (d, j):
                ins = self.best_insert(src, i)
                if ins is not None and self.rank_time(d, {j: ins}) < self.rt[d]:
                    self.apply([(d, j, *ins)])
                    return True
                continue
            if src_t is None:
                src_t = self.price(src)
            ins = self.best_insert(self.splits[e][k], i)
            if ins is None:
                continue
            if e == d:
                new = self.rank_time(d, {j: (src, src_t), k: ins})
            else:
                if src_rt is None:
                    src_rt = self.rank_time(d, {j: (src, src_t)})
                new = max(src_rt, self.rank_time(e, {k: ins}))
            if new < self.rt[d]:
                self.apply([(d, j, src, src_t), (e, k, *ins)])
                return True
        return False

    def swap(self, d: int, j: int, i: int, where: int, d2: int) -> bool:
        """Exchanges sample ``i`` of ``(d, j)`` with a cheaper one of a micro-batch of ``d2``."""
        c = self.ctx
        src = _without(self.splits[d][j], i, where)
        for k in self.full_d2:
            tgt = self.splits[d2][k]
            for b, wb in _samples(tgt):
                if not c.costs[b] < c.costs[i]:
                    continue
                if self.spent():
                    return False
                new_src = self.best_insert(src, b)
                new_tgt = self.best_insert(_without(tgt, b, wb), i) if new_src else None
                if new_tgt is None:
                    continue
                new = max(self.rank_time(d, {j: new_src}), self.rank_time(d2, {k: new_tgt}))
                if new < self.rt[d]:
                    self.apply([(d, j, *new_src), (d2, k, *new_tgt)])
                    return True
        return False

    def merge(self, d: int) -> bool:
        """Merges two of ``d``'s fastest non-empty micro-batches when that is faster."""
        c = self.ctx
        cands = self.fastest(d, nonempty=True)
        for x, a in enumerate(cands):
            for b in cands[x + 1:]:
                if self.spent():
                    return False
                group = [i for p in (self.splits[d][a], self.splits[d][b])
                         for i, _ in _samples(p)]
                if sum(int(c.lengths[i]) for i in group) > c.bucket_size * c.cp_size:
                    continue
                self.work += PLACE_WORK_FACTOR * (len(group) + c.cp_size)
                placed = place_group(c, group)
                if placed is None:
                    continue
                t = self.price(placed)
                none = ([], [[] for _ in range(c.cp_size)])
                if self.rank_time(d, {a: (placed, t), b: (none, 0.0)}) < self.rt[d]:
                    self.apply([(d, a, placed, t), (d, b, none, 0.0)])
                    return True
        return False

    def step(self) -> bool:
        """One accepted move from the slowest DP rank; ``False`` at a local optimum."""
        rt = self.rt
        d = max(range(len(rt)), key=lambda x: (rt[x], -x))
        d2 = min(range(len(rt)), key=lambda x: (rt[x], x))
        order = [j for _, j in sorted((-self.mbt[d][j], j)
                                      for j, p in enumerate(self.splits[d]) if not _empty(p))]
        # The targets of every move of this step (none changes before one is accepted).
        self.fast_d = self.fastest(d, TARGETS + 1)
        self.fast_d2 = self.fastest(d2) if d2 != d else []
        self.full_d2 = self.fastest(d2, nonempty=True) if d2 != d else []
        for move in (self.relocate, self.swap) if d2 != d else (self.relocate,):
            for j in order:
                for i, where in _samples(self.splits[d][j]):
                    if move(d, j, i, where, d2):
                        return True
                    if self.spent():
                        return False
        return self.merge(d)

    def result(self) -> list[list[Placement]]:
        """Non-empty micro-batches first (in order), equal counts, all-empty ones dropped."""
        full = [[p for p in s if not _empty(p)] for s in self.splits]
        m = max(1, max(len(s) for s in full))
        return [s + [([], [[] for _ in range(self.ctx.cp_size)]) for _ in range(m - len(s))]
                for s in full]


def refine(ctx: GdsContext, splits, overhead: float, budget: int) -> list[list[Placement]]:
    """Local search on ``splits`` (``[D][M]`` placements) within ``budget`` work units.

    Returns equally long micro-batch lists whose predicted iteration time is at most the
    input's; ``budget <= 0`` returns ``splits`` unchanged.
    """
    return refine_spent(ctx, splits, overhead, budget)[0]


def refine_spent(ctx: GdsContext, splits, overhead: float, budget: int
                 ) -> tuple[list[list[Placement]], int]:
    """:func:`refine` and the work units it counted (the portfolio gives the rest of its
    budget to :func:`~skrull_ext.scheduler.lns.lns`)."""
    if budget <= 0:
        return splits, 0
    search = _Search(ctx, splits, overhead, budget)
    while not search.spent() and search.step():
        pass
    return search.result(), search.work


__all__ = ["BUDGET_SCALE_K", "BUDGET_SCALE_MAX", "DEFAULT_BUDGET_MS", "all_distributed", "budget_ms_arg", "place_group", "PLACE_WORK_FACTOR", "TARGETS", "WORK_UNITS_PER_MS",
           "budget_work", "refine", "refine_spent"]
