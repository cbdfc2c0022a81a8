"""Refitting a cost model to the machine it runs on, from measured iteration times.

A preset (``h100``, ``cpu``) or a ``--skrull-cost-model-config`` file *seeds* the cost model;
during training the time each iteration took is compared with what the seed predicts for
that iteration's plan, and the seed is rescaled so the two agree.

Per iteration ``i`` the caller supplies :data:`FEATURES` (the plan's predicted seconds
under each of :func:`term_models`) and the measured seconds ``y_i``; :func:`additive` turns
them into the *term seconds* ``f_i[j]`` of :data:`TERMS` -- linear FLOPs, attention FLOPs
(long-block rate), the attention's short-block surcharge (``attention_half_tokens``), the
per-micro-batch overhead, the per-kernel-call overhead and the ring communication left
exposed -- which add up to the seed's whole prediction ``p_i`` without its fixed
per-iteration overhead.  The short-block surcharge is a term of its own because it grows with the tokens,
not with their square: a seed whose kernel loses more on short blocks than this machine's
(the ``cpu`` preset's 579 half-tokens against ~1 fitted for the demo model) over-predicts
short iterations against long ones, and no common factor fixes that.  Two fits, both by least
squares on *relative* residuals ``(y_i - fit_i) / y_i`` (iterations differ in length by
orders of magnitude; a long one must not drown the short ones), robust to outliers (Huber
weights by iteratively reweighted least squares), over a window of recent iterations
with recent ones weighted more (``half_life``: the load of a shared machine drifts):

1. **Scale**: ``y_i ~= s p_i + b``.  Every term of the seed scaled alike; exact for the
   seed's own composition of the terms (the ring overlap is a ``max``, so a common factor
   passes through it), and well determined after two or three iterations.
2. **Terms** (once :attr:`RefitConfig.terms_after` iterations are in the window; until
   then every ``w_j = s``, which keeps the seed's plan decisions; since the terms add up
   to ``p_i``, ``w_j = s`` is stage 1's fit):
   ``y_i ~= sum_j w_j f_i[j] + b`` with a ridge pulling every ``w_j`` towards
   ``s`` (not towards the seed's 1: a seed a thousand times too fast would otherwise bias
   every prediction towards it).  A term moves away from the common scale only as far as
   the iterations' differing mixes of terms demand.

Outputs are rounded to 9 significant digits, so ranks whose BLAS differ in the last bits
still plan with identical models.  Pure numpy and deterministic: the same inputs (the
plans, identical everywhere, and measured times all-reduced by the caller) give the same
coefficients on every rank.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Optional, Sequence

import numpy as np

from skrull_ext.costmodel.model import CommModel, CostModel, TimeModel

TERMS = ("c_linear", "c_attention", "attention_short", "micro_batch_overhead",
         "attention_call_overhead", "comm")
# The seed's coefficients behind the compute terms (``attention_short`` is c_attention's
# ``attention_half_tokens`` part).
_COEFFS = ("c_linear", "c_attention", "micro_batch_overhead", "attention_call_overhead")
# What the caller predicts per iteration (one cost model each, :func:`term_models`):
# the compute terms alone (``c_attention`` at the long-block rate, ``attention`` with
# the seed's short-block surcharge), then the seed's whole prediction without its
# ``iteration_overhead``.  :func:`additive` turns them into the refit's term seconds.
FEATURES = ("c_linear", "c_attention", "attention", "micro_batch_overhead",
            "attention_call_overhead", "full")


def term_models(cost: CostModel) -> dict[str, CostModel]:
    """One cost model per :data:`FEATURES` entry (``full``: ``cost`` without its overhead).

    ``iteration_overhead`` is the refit's intercept and is 0 in every term model.
    """
    t = cost.time
    zero_comm = CommModel(sizes_bytes=(0.0, 1.0), seconds=(0.0, 0.0))
    out = {}
    for name in FEATURES[:-1]:
        coeff = "c_attention" if name == "attention" else name
        kw = {k: 0.0 for k in _COEFFS}
        kw[coeff] = getattr(t, coeff)
        half = t.attention_half_tokens if name == "attention" else 0.0
        out[name] = dataclasses.replace(
            cost, comm=zero_comm, time=TimeModel(attention_half_tokens=half,
                                                 iteration_overhead=0.0, **kw))
    out["full"] = dataclasses.replace(cost, time=dataclasses.replace(t, iteration_overhead=0.0))
    return out


def additive(features: Sequence[float]) -> np.ndarray:
    """:data:`FEATURES` seconds -> ``[len(TERMS) + 1]``: the term seconds, then ``full``.

    The short-block surcharge is the attention with it minus without it; the exposed
    communication is what the whole prediction holds beyond the compute terms (the ring
    overlap hides the rest), so the terms add up to ``full``.
    """
    lin, attn, attn_all, micro, calls, full = (float(v) for v in features)
    compute = np.array([lin, attn, max(attn_all - attn, 0.0), micro, calls])
    total = float(compute.sum())
    comm = full - total
    if comm <= 1e-9 * full:  # no exposed ring time (or rounding noise of a hidden one)
        # Each term model picks its own slowest CP / DP rank, so the terms can add up to
        # more than the slowest rank's time: share that time out in their proportions.
        compute *= full / total if total > 0 else 0.0
        comm = 0.0
    return np.append(compute, [comm, full])


def scaled(cost: CostModel, multipliers: Sequence[float], overhead: float) -> CostModel:
    """``cost`` with each :data:`TERMS` entry scaled and ``iteration_overhead`` set."""
    w = dict(zip(TERMS, (float(x) for x in multipliers)))
    t = cost.time
    # c (1 + h / s) scaled per part: c' = w_attn c, h' = h w_short / w_attn.
    half = t.attention_half_tokens * w["attention_short"] / w["c_attention"] \
        if w["c_attention"] > 0 else 0.0
    # The ring steps' fixed cost is part of the ring's exposed time: the comm term's.
    time = dataclasses.replace(t, iteration_overhead=float(overhead), attention_half_tokens=half,
                               ring_step_overhead=t.ring_step_overhead * w["comm"],
                               **{k: getattr(t, k) * w[k] for k in _COEFFS})
    comm = CommModel(sizes_bytes=cost.comm.sizes_bytes,
                     seconds=tuple(s * w["comm"] for s in cost.comm.seconds))
    return dataclasses.replace(cost, time=time, comm=comm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RefitConfig:
    """How the online refit weighs its data.

    Attributes:
        window: Iterations kept (oldest dropped first).
        min_samples: Iterations seen before the first refit.
        ridge: Pull of each term's multiplier towards the common scale, relative to the
            data's weight (0: none; large: a pure rescaling of the seed).
        huber: Residuals beyond this many robust standard deviations get weight
            ``huber / |r|`` (outlier iterations: a checkpoint save, a slow neighbour).
        skip_first: Iterations ignored at the start (warm-up: allocator, kernel caches).
        half_life: An iteration's weight halves every ``half_life`` newer iterations.
        terms_after: Iterations in the window before the per-term stage runs; until then
            every term gets the common scale, which keeps the seed's relative costs and so
            its plan decisions.  The terms add up to the seed's prediction, so the
            per-term fit starts from stage 1's and the ridge keeps a term there unless the
            iterations' mixes say otherwise (in the CPU demo the ``cpu`` seed's attention
            needs ~1.5x the common scale, which only the first long iterations show).
            Five (was eight): in a closed-loop replay of the demo (15% noise, the first
            four iterations 1.4x slow) it gave the ``cpu`` seed 19% median error against
            25-26% for three or eight, the fitted seed 21% with each.
    """

    window: int = 16
    min_samples: int = 2
    ridge: float = 1.0
    huber: float = 1.5
    skip_first: int = 1
    half_life: float = 8.0
    terms_after: int = 5


class OnlineRefit:
    """Keeps a window of ``(features, measured seconds)`` and refits the seed.

    Args:
        seed: The cost model to start from.
        config: Window and robustness settings.
    """

    def __init__(self, seed: CostModel, config: RefitConfig = RefitConfig()):
        self.seed, self.config = seed, config
        self.terms = term_models(seed)
        self.rows: deque = deque(maxlen=config.window)
        self.seen = 0
        self.scale = 1.0
        self.multipliers = np.ones(len(TERMS))
        self.overhead = float(seed.time.iteration_overhead)

    def observe(self, features: Sequence[float], measured_seconds: float) -> Optional[CostModel]:
        """Adds one iteration (``features``: ``[len(FEATURES)]`` seconds); returns the
        refitted cost model (``None`` while warming up or for a non-finite time)."""
        self.seen += 1
        if self.seen <= self.config.skip_first or not np.isfinite(measured_seconds) \
                or measured_seconds <= 0:
            return None
        self.rows.append((additive(features), float(measured_seconds)))
        if len(self.rows) < self.config.min_samples:
            return None
        x = np.stack([r[0] for r in self.rows])
        y = np.array([r[1] for r in self.rows])
        self.multipliers, self.overhead, self.scale = robust_fit(
            x, y, seed_overhead=self.seed.time.iteration_overhead, config=self.config)
        return self.current()

    def current(self) -> CostModel:
        """The seed scaled by the latest fit."""
        return scaled(self.seed, self.multipliers, self.overhead)


def robust_fit(x: np.ndarray, y: np.ndarray, *, seed_overhead: float,
               config: RefitConfig = RefitConfig()) -> tuple[np.ndarray, float, float]:
    """The two fits of the module docstring, oldest row first.

    Args:
        x: ``[n, len(TERMS) + 1]`` term seconds and the seed's prediction per iteration
            (:func:`additive`).
        y: ``[n]`` measured seconds (> 0).
        seed_overhead: The seed's ``iteration_overhead`` (the intercept's starting point).
        config: Ridge, Huber threshold and recency half-life.

    Returns:
        ``(w [len(TERMS)] >= 0, b >= 0, s)``: term multipliers, fixed per-iteration
        seconds and the common scale, rounded to 9 significant digits.
    """
    n, k = x.shape[0], len(TERMS)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    recency = 0.5 ** (np.arange(n - 1, -1, -1) / max(config.half_life, 1e-9))
    full = x[:, k]
    # Stage 1: y ~= s p + b, pulled (weakly) to the pure rescaling y ~= s0 (p + b_seed).
    s0 = _wmedian(y / np.maximum(full + seed_overhead, 1e-12), recency)
    a1 = np.stack([full, np.ones(n)], axis=1)
    (s, b), _ = _irls(a1, y, recency, np.array([s0, s0 * seed_overhead]), 0.05, config.huber)
    s = s if s > 0 else s0
    coef = np.append(np.full(k, s), b)
    if n >= config.terms_after:  # stage 2: the terms, each pulled towards the common scale
        a2 = np.hstack([x[:, :k], np.ones((n, 1))])
        coef, _ = _irls(a2, y, recency, coef, config.ridge, config.huber)
    coef = _round(coef)
    return coef[:k], float(coef[k]), float(_round(np.array([s]))[0])


_REJECT = 4.0  # robust standard deviations beyond which an iteration is dropped


def _wmedian(v: np.ndarray, w: np.ndarray) -> float:
    """Weighted median (the lower one at an exact tie)."""
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    return float(v[order][np.searchsorted(cum, 0.5 * cum[-1])])


def _round(v: np.ndarray, digits: int = 9) -> np.ndarray:
    return np.array([float(f"{float(t):.{digits}g}") for t in v])


def _irls(a, y, recency, prior, ridge, huber, iters: int = 10):
    """Huber-weighted, ridge-to-``prior``, non-negative fit of ``y ~= a coef`` (relative).

    Args:
        a: ``[n, m]`` regressors; y: ``[n]`` targets; recency: ``[n]`` row weights.
        prior: ``[m]`` coefficients the ridge pulls towards.
        ridge: Strength relative to the rows' total weight.
        huber: Huber threshold in robust standard deviations.

    Returns:
        ``(coef [m] >= 0, row weights [n])``.
    """
    rel = 1.0 / np.maximum(y, 1e-12)
    a = a * rel[:, None]
    yr = y * rel
    # Column scale: a typical iteration's share per unit coefficient, so the ridge acts on
    # (relative) seconds, not on raw coefficients.  Floored relative to the largest: a
    # term (nearly) absent from every iteration (no exposed ring time) keeps its prior.
    scale = np.abs(a).mean(axis=0)
    scale = np.maximum(scale, 1e-3 * max(float(scale.max()), 1e-12))
    coef = prior.copy()
    for _ in range(iters):  # weights from the residuals of the previous fit (first: prior)
        r = yr - a @ coef
        # Recency-weighted scale (after a load change the older iterations are the
        # outliers), floored at 0.5%: exact data must not make tiny residuals outliers.
        sigma = 1.4826 * _wmedian(np.abs(r - _wmedian(r, recency)), recency) + 5e-3
        weights = np.minimum(1.0, huber * sigma / np.maximum(np.abs(r), 1e-300))
        gross = np.abs(r) > _REJECT * sigma
        if recency[~gross].sum() >= 0.5 * recency.sum():  # gross outliers: no weight
            weights[gross] = 0.0
        w = weights * recency
        coef = _ridge_nnls(a, yr, w, prior, scale, ridge * float(w.sum()))
    return coef, weights


def _ridge_nnls(a, y, weights, prior, scale, lam) -> np.ndarray:
    """Weighted ridge solve; coefficients that come out negative are clamped to 0.

    Solves for ``u = coef * scale`` (columns of equal size) with the penalty
    ``lam * sum((u - scale * prior)^2)``: deviations from the prior in seconds.
    """
    active = np.ones(len(prior), dtype=bool)
    coef = np.zeros(len(prior))
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
