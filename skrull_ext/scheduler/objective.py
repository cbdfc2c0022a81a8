"""How a CP rank's time in a micro-batch is composed: :func:`rank_time` (the spec).

Every time estimate of the scheduler (DACP's tests, the LPT search and its bounds, GDS,
the portfolio, the refinement, :func:`~skrull_ext.scheduler.predict`) goes through
:func:`rank_time`; the C++ core's ``skrull::rank_time`` (``csrc/scheduler.h``) repeats its
float operations in the same order.  Its inputs are three sums over one micro-batch:

* ``x``: the rank's local work (its whole samples' ``costs``),
* ``t_comm``: the distributed samples' ``comm`` plus the cost model's ``comm_latency(n)``
  (0 when nothing is distributed),
* ``t_dist``: the distributed samples' ``shares`` (each rank's seconds on them).

With a plain objective name (``"paper"`` / ``"ring"``) they are read as before: ``comm``
is ring transfer seconds and ``shares`` compute inside the ring.  An :class:`Objective`
built by :func:`objective_of` from a :class:`~skrull_ext.costmodel.model.CostModel`
carries the cost model's *ring terms* and reads them as the planner's simulator composes
an iteration (``skrull_ext/planner/simulator.py``; docs/scheduler.md, "One time model"):

* a distributed sample's ``comm`` is every second of it that scales with its shard
  tokens but is no attention: ``(mu_n + lam + nu) x shard`` with ``mu_n`` the ring's
  transfer seconds per shard token (``3 (n - 1)`` steps of ``beta``: forward K/V, backward
  K/V and dK/dV), ``lam`` the linear layers' and ``nu = beta`` the final dK/dV return's;
  ``comm_latency(n) = (2n - 1) ell + n o`` (a latency per step and for the return, and
  the fixed compute overhead ``o`` of each of the ``n`` ring steps);
* ``shares`` hold each rank's attention blocks plus the same ``(lam + nu) x shard``;
* so from ``w = t_comm - comm_latency(n)`` the rank's linear and return seconds are
  ``w (lam + nu) / (mu_n + lam + nu)``: they run outside the ring (before and after the
  attention), the rest ``mu_n S`` is the ring's transfers, and ``t_dist`` less the linear
  and return part is the attention blocks;
* the ring runs twice, forward (``a`` = 1 / 3.5 of the attention work, 1/3 of the bytes)
  and backward (the rest, 2/3 of the bytes), each ``max(a x + b, c) + b + (n - 2)
  max(b, c)`` with ``b`` a block and ``c`` one step (bytes + latency).

Exact against the simulator but for one simplification: a rank's local linear work
counts as able to hide the first exchange (it is inside ``x``).
"""
from __future__ import annotations

import numpy as np

# Byte share of the forward ring (K/V); the backward moves K/V and dK/dV.
_FWD_BYTES = 1.0 / 3.0


class Objective(str):
    """An objective name (``"paper"`` or ``"ring"``) carrying a cost model's ring terms.

    Compares, hashes and prints as its name, so it passes through every function that
    takes an objective name; :func:`rank_time` reads :attr:`terms`.

    Attributes:
        terms: ``(lam, beta, ell, o, a)``: linear seconds per token, ring transfer seconds
            per shard token and step (all layers), latency seconds per step (all layers),
            fixed seconds per ring step (all layers), forward share of attention work.
    """

    def __new__(cls, name: str, terms: tuple = (0.0, 0.0, 0.0, 0.0, 1.0)):
        if name not in ("paper", "ring"):
            raise ValueError(f"objective {name!r}: use 'ring' or 'paper'")
        obj = super().__new__(cls, name)
        obj.terms = tuple(float(t) for t in terms)
        return obj

    def code(self) -> tuple:
        """The C++ core's objective argument: ``(code, lam, beta, ell, o, a)``."""
        return (0 if self == "paper" else 1,) + self.terms


def objective_of(cost_model) -> Objective:
    """The :class:`Objective` of ``cost_model`` (its name and :attr:`ring_terms`)."""
    return Objective(cost_model.objective, cost_model.ring_terms)


def objective_arg(objective):
    """What the C++ core takes as ``objective``: a code, or a tuple with the ring terms."""
    if isinstance(objective, Objective):
        return objective.code()
    return 0 if objective == "paper" else 1


def _split(t_comm, t_dist, n: int, terms):
    """``(outside + ell, ring, blocks, ell)`` of :func:`rank_time` where anything is
    distributed (scalars or arrays)."""
    lam, beta, ell, o = terms[:4]
    mu = 3.0 * (n - 1) * beta
    tot = mu + lam + beta
    frac = (lam + beta) / tot if tot > 0.0 else 0.0
    w = np.maximum(t_comm - ((2.0 * n - 1.0) * ell + n * o), 0.0)
    outside = w * frac
    return outside + ell, w - outside, t_dist - outside + n * o, ell


def rank_time(x: float, t_comm: float, t_dist: float, n: int, objective: str = "paper"
              ) -> float:
    """Seconds of one CP rank in a micro-batch: local work ``x``, ring ``t_comm``,
    distributed ``t_dist`` (see the module doc), ``n`` CP ranks.

    ``paper`` (docs/design.md section 3): ``max(t_comm, x) + t_dist``; the local work hides
    the whole ring's communication, the distributed compute hides none.  ``ring`` (ours):
    the ring as :mod:`skrull_ext.attention.ring` runs it, ``n`` compute blocks of
    ``b = t_dist / n`` and ``n - 1`` exchanges of ``c = t_comm / (n - 1)``; the local work
    and the first block overlap the first exchange, every later exchange overlaps one
    block: ``max(x + b, c) + b + (n - 2) max(b, c)``.  With an :class:`Objective` the terms
    are split as the module doc says (``paper``: the ring's transfers hidden by the local
    work, everything else added), and with nothing distributed (``t_comm = 0``) it is
    ``x + t_dist``.  All are non-decreasing in ``x``; with nothing distributed all are
    ``x``.
    """
    terms = getattr(objective, "terms", None)
    if n < 2 or (terms is None and objective == "paper"):
        return max(t_comm, x) + t_dist
    if terms is None:
        b = t_dist / n
        c = t_comm / (n - 1)
        return max(x + b, c) + b + (n - 2) * max(b, c)
    if not t_comm > 0.0:  # nothing distributed (or a ring that costs nothing)
        return x + t_dist
    lam, beta, ell, o, a = terms
    mu = 3.0 * (n - 1) * beta
    tot = mu + lam + beta
    w = max(t_comm - ((2.0 * n - 1.0) * ell + n * o), 0.0)
    outside = w * ((lam + beta) / tot) if tot > 0.0 else 0.0
    ring = w - outside
    blocks = t_dist - outside + n * o
    out = outside + ell
    if objective == "paper":
        return out + max(ring + 2.0 * (n - 1) * ell, x) + blocks
    t = out
    for share, part in ((a, _FWD_BYTES), (1.0 - a, 1.0 - _FWD_BYTES)):
        b = share * blocks / n
        c = part * ring / (n - 1) + ell
        t = t + (max(share * x + b, c) + b + (n - 2) * max(b, c))
    return t


def rank_times(t_local, t_comm, t_dist, n: int, objective) -> np.ndarray:
    """:func:`rank_time` elementwise over arrays (the same float operations)."""
    terms = getattr(objective, "terms", None)
    if n < 2 or (terms is None and objective == "paper"):
        return np.maximum(t_comm, t_local) + t_dist
    if terms is None:
        b = t_dist / n
        c = t_comm / (n - 1)
        return np.maximum(t_local + b, c) + b + (n - 2) * np.maximum(b, c)
    t_comm = np.asarray(t_comm, dtype=np.float64)
    t_dist = np.asarray(t_dist, dtype=np.float64)
    out, ring, blocks, ell = _split(t_comm, t_dist, n, terms)
    a = terms[4]
    if objective == "paper":
        t = out + np.maximum(ring + 2.0 * (n - 1) * ell, t_local) + blocks
    else:
        t = out
        for share, part in ((a, _FWD_BYTES), (1.0 - a, 1.0 - _FWD_BYTES)):
            b = share * blocks / n
            c = part * ring / (n - 1) + ell
            t = t + (np.maximum(share * t_local + b, c) + b + (n - 2) * np.maximum(b, c))
    return np.where(t_comm > 0.0, t, t_local + t_dist)


__all__ = ["Objective", "objective_arg", "objective_of", "rank_time", "rank_times"]
