"""(ours) Ruin and recreate on a plan with sub-group rings, the rings pinned.

The ``group-fill`` candidate (:mod:`~skrull_ext.scheduler.groupfill`) builds plans with
aligned CP sub-group rings (``MicroBatch.grouped``), which Skrull's own searches do not
place, so its plan was kept as the greedy left it.  The cost model prices a micro-batch
per CP rank as its local and full-ring time plus its sub-group rings' time
(:func:`~skrull_ext.scheduler.pricing.micro_batch_seconds`), and the rings' part depends
on the rings alone.  With each micro-batch's rings pinned where they are, they are a
constant per-CP-rank vector of seconds and of tokens, and ruin and recreate
(:func:`~skrull_ext.scheduler.lns.lns` with ``pins``) moves every other sample of the
plan: between DP ranks, micro-batches and CP ranks, whole or on the full ring.

:func:`refined` runs it on group-fill's winning plan with the default search's budget
(the same work units ``schedule()`` gives its own plan's ruin and recreate), the result
priced like every plan and kept only when strictly faster.  Measured on issue 31's grid
(2026-11-26, d8d06ce): 62 of 360 settings faster by more than 0.1% (up to 1.5%), none
slower; the user file's 0.5B, CP 8, GBS 1024, 2x, ``ring`` setting, 1.013x behind the
300-ms reference search before, within 1% (docs/scheduler.md).  Both backends give the same plan (``_C.lns_pinned``,
tests/test_pinned.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.model import CostModel
import skrull_ext.scheduler.lns as lns_mod
import skrull_ext.scheduler.refine as refine_mod
from skrull_ext.scheduler.config import SchedulerConfig, _ROLLBACK_CODES, _VARIANT_CODES
from skrull_ext.scheduler.hybrid import winner
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.scheduler.pricing import _grouped_seconds, predict_arrays, ring_seconds
from skrull_ext.scheduler.reference import GdsContext


def pinned_rings(plan: Plan, cost_model: CostModel):
    """``(splits, groups, seconds, tokens)`` of ``plan`` for :func:`lns.lns` with pins.

    ``splits``: ``[D][M]`` placements ``(distributed, local)``, or ``(distributed, local,
    id)`` for a micro-batch with sub-group rings (empty micro-batches dropped);
    ``groups[id]``: its ``grouped`` tuples; ``seconds`` / ``tokens`` ``[P, N]``: what they
    add to each CP rank, from the pricing's own functions (so the constants are exact).
    """
    n = plan.cp_size
    splits, groups, tokens, mbs, rows = [], [], [], [], []
    for rank in plan.dp_ranks:
        split = []
        for mb in rank:
            if mb.is_empty():
                continue
            p = (list(mb.distributed), [list(r) for r in mb.local])
            if mb.grouped:
                mbs += [len(groups)] * len(mb.grouped)
                rows += mb.grouped
                rings = MicroBatch(distributed=(), local=((),) * n, grouped=mb.grouped)
                tokens.append(rings.rank_tokens(plan.lengths))
                p += (len(groups),)
                groups.append(tuple(mb.grouped))
            split.append(p)
        splits.append(split)
    seconds = ring_seconds(mbs, _grouped_seconds(rows, plan.lengths, cost_model), len(groups),
                           n, cost_model).tolist()
    return splits, groups, seconds, tokens


def lns_budget(config: SchedulerConfig, k: int) -> int:
    """Ruin and recreate's units for the whole default budget (as
    :func:`~skrull_ext.scheduler.portfolio.refine_and_lns` converts the local search's)."""
    work = refine_mod.budget_work(config.plan_budget_ms, k)
    return work * lns_mod.WORK_UNITS_PER_MS // refine_mod.WORK_UNITS_PER_MS


def refined(plan: Plan, best: float, config: SchedulerConfig, cost_model: CostModel, arrays,
            floor_t: float, backend: str = "python") -> Optional[Plan]:
    """``plan`` (a validated plan with sub-group rings) after ruin and recreate with its
    rings pinned, as Skrull's plan (``predicted["candidate"] = "group-fill"``) when
    predicted strictly faster than ``best``, else ``None``.

    Args:
        arrays: ``(costs, shares, comm)`` as ``schedule()`` computed them.
        floor_t: Where the search stops: the batch's lower bound less the iteration's
            fixed overhead (its DP ranks' time cannot go below it).
    """
    arr = plan.lengths
    budget = lns_budget(config, arr.size)
    if budget <= 0 or arr.size > lns_mod.MAX_LNS_SAMPLES:
        return None
    costs, shares, comm = arrays
    n, c, ovh = config.cp_size, config.bucket_size, cost_model.micro_batch_overhead
    latency, objective = cost_model.comm_latency(n), objective_of(cost_model)
    splits, groups, seconds, tokens = pinned_rings(plan, cost_model)
    if not groups:
        return None
    if backend == "cpp" and hasattr(_backend.CPP, "lns_pinned"):
        out, _ = _backend.CPP.lns_pinned(
            splits, np.asarray(seconds, dtype=np.float64), np.asarray(tokens, dtype=np.int64),
            arr, costs, comm, latency, n, c, _ROLLBACK_CODES[config.rollback],
            _VARIANT_CODES[config.dacp], ovh, shares, objective_arg(objective), budget, floor_t)
    else:
        ctx = GdsContext(arr, costs, comm, latency, n, c, config.rollback, config.dacp, shares,
                         objective)
        out = lns_mod.lns(ctx, splits, ovh, budget, floor_t,
                          pins={x: (seconds[x], tokens[x]) for x in range(len(groups))})
    m = max(1, max(len(s) for s in out))
    ranks = tuple(tuple(MicroBatch(distributed=tuple(int(i) for i in p[0]),
                                   local=tuple(tuple(int(i) for i in r) for r in p[1]),
                                   grouped=groups[p[2]] if len(p) > 2 else ())
                        for p in s) + (MicroBatch.empty(n),) * (m - len(s)) for s in out)
    cand = Plan(lengths=arr, dp_size=config.dp_size, cp_size=n, bucket_size=c,
                policy="skrull", dp_ranks=ranks)
    cand.validate()
    return winner((cand, predict_arrays(cand, cost_model, costs, comm, shares)), best,
                  "group-fill")


__all__ = ["lns_budget", "pinned_rings", "refined"]
