"""Refitting a cost model to the machine it runs on, from measured iteration times.

A preset (``h100``, ``cpu``) or a ``--skrull-cost-model-config`` file *seeds* the cost model;
during training the time each iteration took is compared with what the seed's terms
predict for that iteration's plan, and the terms are rescaled so the two agree.

Per iteration ``i`` the caller supplies *term seconds* ``f_i[j]``: the plan's predicted
time with only term ``j`` of the seed switched on (:data:`TERMS`: linear FLOPs, attention
FLOPs, the per-micro-batch overhead, the per-kernel-call overhead, and the ring's
communication) and the measured seconds ``y_i``.  The refit finds multipliers ``w >= 0``
and a fixed per-iteration overhead ``b >= 0`` with::

    y_i ~= sum_j w_j f_i[j] + b

by least squares on *relative* residuals ``(y_i - fit_i) / y_i`` (iterations differ in
length by orders of magnitude; a long one must not drown the short ones) over a window of
recent iterations, robust to outliers (Huber weights by iteratively reweighted least
squares) and pulled towards the seed (``w = 1``, ``b = seed overhead``) by a small ridge
term, so a handful of similar iterations cannot swing a poorly determined term.  Pure numpy and deterministic: the same inputs give the
same coefficients on every rank.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Optional, Sequence

import numpy as np

from skrull_ext.costmodel.model import CommModel, CostModel, TimeModel

TERMS = ("c_linear", "c_attention", "micro_batch_overhead", "attention_call_overhead", "comm")


def term_models(cost: CostModel) -> dict[str, CostModel]:
    """One cost model per :data:`TERMS` entry with only that term of ``cost`` switched on.

    ``attention_half_tokens`` (a shape parameter, not a scale) stays in the attention term;
    ``iteration_overhead`` is the refit's intercept and is 0 in every term model.
    """
    t = cost.time
    zero_comm = CommModel(sizes_bytes=(0.0, 1.0), seconds=(0.0, 0.0))
    out = {}
    for name in TERMS[:-1]:
        kw = {k: 0.0 for k in TERMS[:-1]}
        kw[name] = getattr(t, name)
        out[name] = dataclasses.replace(
            cost, comm=zero_comm, time=TimeModel(attention_half_tokens=t.attention_half_tokens,
                                                 iteration_overhead=0.0, **kw))
    silent = TimeModel(c_linear=0.0, c_attention=0.0)
    out["comm"] = dataclasses.replace(cost, time=silent)
    return out


def scaled(cost: CostModel, multipliers: Sequence[float], overhead: float) -> CostModel:
    """``cost`` with each :data:`TERMS` entry scaled and ``iteration_overhead`` set."""
    w = dict(zip(TERMS, (float(x) for x in multipliers)))
    t = cost.time
    time = dataclasses.replace(t, iteration_overhead=float(overhead),
                               **{k: getattr(t, k) * w[k] for k in TERMS[:-1]})
    comm = CommModel(sizes_bytes=cost.comm.sizes_bytes,
                     seconds=tuple(s * w["comm"] for s in cost.comm.seconds))
    return dataclasses.replace(cost, time=time, comm=comm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RefitConfig:
    """How the online refit weighs its data.

    Attributes:
        window: Iterations kept (oldest dropped first).
        min_samples: Iterations seen before the first refit.
        ridge: Pull towards the seed, relative to the data's scale (0: none).
        huber: Residuals beyond this many robust standard deviations get weight
            ``huber / |r|`` (outlier iterations: a checkpoint save, a slow neighbour).
        skip_first: Iterations ignored at the start (warm-up: allocator, kernel caches).
    """

    window: int = 16
    min_samples: int = 2
    ridge: float = 0.05
    huber: float = 1.5
    skip_first: int = 1


class OnlineRefit:
    """Keeps a window of ``(term seconds, measured seconds)`` and refits the multipliers.

    Args:
        seed: The cost model to start from and to pull towards.
        config: Window and robustness settings.
    """

    def __init__(self, seed: CostModel, config: RefitConfig = RefitConfig()):
        self.seed, self.config = seed, config
        self.terms = term_models(seed)
        self.rows: deque = deque(maxlen=config.window)
        self.seen = 0
        self.multipliers = np.ones(len(TERMS))
        self.overhead = float(seed.time.iteration_overhead)

    def observe(self, features: Sequence[float], measured_seconds: float) -> Optional[CostModel]:
        """Adds one iteration; returns the refitted cost model (``None`` while warming up)."""
        self.seen += 1
        if self.seen <= self.config.skip_first or not np.isfinite(measured_seconds):
            return None
        self.rows.append((np.asarray(features, dtype=np.float64), float(measured_seconds)))
        if len(self.rows) < self.config.min_samples:
            return None
        x = np.stack([r[0] for r in self.rows])
        y = np.array([r[1] for r in self.rows])
        self.multipliers, self.overhead = robust_fit(
            x, y, prior=np.ones(len(TERMS)), prior_overhead=self.seed.time.iteration_overhead,
            ridge=self.config.ridge, huber=self.config.huber)
        return self.current()

    def current(self) -> CostModel:
        """The seed scaled by the latest fit."""
        return scaled(self.seed, self.multipliers, self.overhead)


def robust_fit(x: np.ndarray, y: np.ndarray, *, prior: np.ndarray, prior_overhead: float,
               ridge: float, huber: float, iters: int = 10) -> tuple[np.ndarray, float]:
    """Huber-weighted, ridge-to-prior, non-negative least squares of ``y ~= x w + b``.

    Residuals are relative (each row divided by its ``y``).

    Args:
        x: ``[n, k]`` term seconds per iteration.
        y: ``[n]`` measured seconds.
        prior: ``[k]`` multipliers the ridge pulls towards.
        prior_overhead: Intercept the ridge pulls towards.
        ridge: Strength relative to ``mean(y)^2`` per coefficient.
        huber: Huber threshold in robust standard deviations.

    Returns:
        ``(w [k] >= 0, b >= 0)``.
    """
    n, k = x.shape
    rel = 1.0 / np.maximum(y, 1e-12)
    a = np.hstack([x, np.ones((n, 1))]) * rel[:, None]
    y = y * rel
    p = np.append(prior, prior_overhead)
    # Column scale: the prior's contribution to a typical iteration, so the ridge acts on
    # seconds, not on raw multipliers.
    scale = np.maximum(np.abs(a).mean(axis=0), 1e-12)
    lam = ridge * n
    weights = np.ones(n)
    active = np.ones(k + 1, dtype=bool)
    coef = p.copy()
    for _ in range(iters):
        coef = _ridge_nnls(a, y, weights, p, scale, lam, active)
        r = y - a @ coef
        sigma = 1.4826 * np.median(np.abs(r - np.median(r))) + 1e-12
        weights = np.minimum(1.0, huber * sigma / np.maximum(np.abs(r), 1e-300))
    return coef[:k], float(coef[k])


def _ridge_nnls(a, y, weights, prior, scale, lam, active) -> np.ndarray:
    """Weighted ridge solve; coefficients that come out negative are clamped to 0.

    Solves for ``u = coef * scale`` (columns of equal size) with the penalty
    ``lam * sum((u - scale * prior)^2)``: deviations from the prior in seconds.
    """
    active = active.copy()
    coef = np.zeros_like(prior)
    sw = np.sqrt(weights)
    while active.any():
        cols = np.flatnonzero(active)
        lhs = np.vstack([a[:, cols] / scale[cols] * sw[:, None],
                         np.sqrt(lam) * np.eye(len(cols))])
        rhs = np.concatenate([y * sw, np.sqrt(lam) * scale[cols] * prior[cols]])
        sol, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
        sol = sol / scale[cols]
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[cols] = sol
            return coef
        active[cols[int(np.argmin(sol))]] = False
    return coef
