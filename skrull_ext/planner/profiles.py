"""Sequence-length profiles and a seeded global-batch sampler.

A :class:`LengthProfile` is either

* *published*: a piecewise **log-linear** cumulative distribution through published points
  ``(L_i, F_i)`` (``F_i`` = share of sequences strictly shorter than ``L_i``).  The first
  point is ``(min_length, 0)`` (16 tokens unless the data file says otherwise), the last
  is ``(max_length, 1)``; a published threshold beyond the maximum is dropped (its share
  is 100% already).  Between two points the length is log-uniform, i.e. the inverse CDF is
  ``L(u) = L_i * (L_{i+1} / L_i) ** ((u - F_i) / (F_{i+1} - F_i))``; a draw is
  ``floor(L(u))`` so that ``P(length < L_i) = F_i`` exactly at every published point.
  Mixtures (the Llama 3 SFT mix) are sums of log-uniform components and therefore also
  piecewise log-linear; they are converted to points at every component end.
* *empirical*: a user's own lengths (file or Megatron ``.idx``), sampled with replacement.

Bundled profiles live in ``skrull_ext/planner/data/<name>.json`` with their sources; ``K`` there
means 1024 tokens.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from skrull_ext.planner.lengths_io import read_lengths, read_megatron_idx_lengths

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
OVERFLOW_POLICIES = ("error", "truncate", "redraw")


def profile_names() -> list[str]:
    """Names of the bundled profiles (``skrull_ext/planner/data/*.json``)."""
    return sorted(f[:-5] for f in os.listdir(DATA_DIR) if f.endswith(".json"))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LengthProfile:
    """A distribution of sequence lengths.

    Attributes:
        name: Short name (``wikipedia``, ``my-data``...).
        source: Where the numbers come from (citation or file path).
        points: ``[(length, cumulative share)]`` of the piecewise log-linear CDF (published
            profiles); empty for empirical ones.
        lengths: ``[K]`` int64 observed lengths (empirical profiles) or ``None``.
        published: ``[(threshold, share)]`` points as published, for checks and printing.
    """

    name: str
    source: str
    points: tuple[tuple[float, float], ...] = ()
    lengths: Optional[np.ndarray] = None
    published: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        if (self.lengths is None) == (not self.points):
            raise ValueError("a LengthProfile needs exactly one of points or lengths")
        if self.points:
            xs = [p[0] for p in self.points]
            fs = [p[1] for p in self.points]
            if len(xs) < 2 or any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] < 1:
                raise ValueError(f"profile {self.name}: point lengths must increase from >= 1")
            if fs[0] != 0.0 or fs[-1] != 1.0 or any(b < a for a, b in zip(fs, fs[1:])):
                raise ValueError(f"profile {self.name}: shares must rise from 0 to 1")
        elif self.lengths.size == 0 or self.lengths.min() < 1:
            raise ValueError(f"profile {self.name}: empirical lengths must be >= 1 and non-empty")

    @property
    def min_length(self) -> int:
        return int(self.points[0][0]) if self.points else int(self.lengths.min())

    @property
    def max_length(self) -> int:
        return int(self.points[-1][0]) if self.points else int(self.lengths.max())

    def cdf(self, x) -> np.ndarray:
        """Share of sequences strictly shorter than ``x`` (array-like)."""
        x = np.asarray(x, dtype=np.float64)
        if self.lengths is not None:
            srt = np.sort(self.lengths)
            return np.searchsorted(srt, x, side="left") / srt.size
        xs = np.log([p[0] for p in self.points])
        fs = np.asarray([p[1] for p in self.points])
        return np.interp(np.log(np.maximum(x, 1e-300)), xs, fs, left=0.0, right=1.0)

    def _quantile(self, u: np.ndarray) -> np.ndarray:
        xs = np.log(np.asarray([p[0] for p in self.points]))
        fs = np.asarray([p[1] for p in self.points])
        # Segment i holds F_i <= u < F_{i+1}; zero-mass segments (F_i == F_{i+1}) are skipped.
        i = np.clip(np.searchsorted(fs, u, side="right") - 1, 0, len(fs) - 2)
        width = fs[i + 1] - fs[i]
        frac = np.where(width > 0, (u - fs[i]) / np.where(width > 0, width, 1.0), 0.0)
        return np.exp(xs[i] + frac * (xs[i + 1] - xs[i]))

    def sample(self, n: int, rng: np.random.Generator, below: Optional[int] = None
               ) -> np.ndarray:
        """``[n]`` int64 lengths drawn independently; all ``< below`` when given."""
        if self.lengths is not None:
            pool = self.lengths if below is None else self.lengths[self.lengths < below]
            if pool.size == 0:
                raise ValueError(f"profile {self.name}: no length below {below}")
            return pool[rng.integers(0, pool.size, size=n)].astype(np.int64)
        top = 1.0 if below is None else float(self.cdf(below))
        if top <= 0.0:
            raise ValueError(f"profile {self.name}: no length below {below}")
        u = rng.random(n) * top
        out = np.floor(self._quantile(u)).astype(np.int64)
        return np.clip(out, self.min_length, self.max_length if below is None else below - 1)

    def mean(self) -> float:
        """Expected length (exact for the log-linear pieces, ignoring the floor)."""
        if self.lengths is not None:
            return float(self.lengths.mean())
        total = 0.0
        for (a, fa), (b, fb) in zip(self.points, self.points[1:]):
            if fb > fa:
                total += (fb - fa) * (b - a) / math.log(b / a)
        return total

    def scaled(self, factor: float) -> "LengthProfile":
        """The profile with every length multiplied by ``factor`` (``--scale``), >= 1 token."""
        if not factor > 0:
            raise ValueError(f"--scale must be > 0, got {factor}")
        if factor == 1.0:
            return self
        name = f"{self.name}x{factor:g}"
        if self.lengths is not None:
            scaled = np.maximum(np.ceil(self.lengths * factor), 1).astype(np.int64)
            return LengthProfile(name=name, source=self.source, lengths=scaled)
        pts, last = [], 0.0
        for x, f in self.points:
            x = max(x * factor, 1.0)
            if x > last:  # scaling below 1 token can merge points; keep the larger share
                pts.append((x, f))
            else:
                pts[-1] = (pts[-1][0], f)
            last = x
        if len(pts) < 2:
            pts = [(1.0, 0.0), (2.0, 1.0)]
        return LengthProfile(name=name, source=self.source, points=tuple(pts),
                             published=tuple((x * factor, f) for x, f in self.published))

    def summary(self) -> str:
        """One line: name, mean, max and the shares below 1K/4K/8K/32K/128K."""
        thresholds = (1024, 4096, 8192, 32768, 131072)
        shares = " / ".join(f"{100 * s:.2f}" for s in self.cdf(thresholds))
        return (f"{self.name}: mean {self.mean():.0f}, max {self.max_length} tokens; "
                f"% shorter than 1K/4K/8K/32K/128K: {shares}")


def _log_uniform_mean(a: float, b: float) -> float:
    return (b - a) / math.log(b / a) if b > a else a


def _solve_end(mean: float, lo: Optional[float], hi: Optional[float]) -> tuple[float, float]:
    """The log-uniform range ``[lo, hi]`` with the given mean, one end fixed (bisection)."""
    if (lo is None) == (hi is None):
        raise ValueError("a mixture component fixes exactly one of min_length, max_length_k")
    fixed = lo if lo is not None else hi
    if (lo is not None and mean <= lo) or (hi is not None and mean >= hi):
        raise ValueError(f"component mean {mean} is outside its fixed end {fixed}")
    lg_lo, lg_hi = (math.log(fixed), math.log(fixed) + 30) if lo else (0.0, math.log(fixed))
    for _ in range(200):
        mid = 0.5 * (lg_lo + lg_hi)
        m = _log_uniform_mean(fixed, math.exp(mid)) if lo else _log_uniform_mean(math.exp(mid),
                                                                                 fixed)
        if m < mean:
            lg_lo = mid
        else:
            lg_hi = mid
    other = math.exp(0.5 * (lg_lo + lg_hi))
    return (fixed, other) if lo else (other, fixed)


def _mixture_points(components: Sequence[dict], k: float) -> tuple[tuple[float, float], ...]:
    """Piecewise log-linear CDF points of a mixture of log-uniform components."""
    ranges, weights = [], []
    for c in components:
        hi = c["max_length_k"] * k if "max_length_k" in c else None
        ranges.append(_solve_end(c["mean_k"] * k, c.get("min_length"), hi))
        weights.append(float(c["weight"]))
    if abs(sum(weights) - 1.0) > 1e-9:
        raise ValueError(f"mixture weights sum to {sum(weights)}, expected 1")
    breaks = sorted({x for r in ranges for x in r})

    def cdf(x: float) -> float:
        total = 0.0
        for (a, b), w in zip(ranges, weights):
            total += w * min(max(math.log(x / a) / math.log(b / a), 0.0), 1.0)
        return total

    pts = [(x, cdf(x)) for x in breaks]
    pts[0], pts[-1] = (pts[0][0], 0.0), (pts[-1][0], 1.0)
    return tuple(pts)


def _cumulative_points(obj: dict, k: float):
    thresholds = [t * k for t in obj["thresholds_k"]]
    shares = [s / 100.0 for s in obj["shares_percent"]]
    max_len = float(obj["max_length_k"]) * k
    pts = [(float(obj.get("min_length", 16)), 0.0)]
    for t, s in zip(thresholds, shares):
        if t < max_len and s < 1.0:
            pts.append((t, s))
    pts.append((max_len, 1.0))
    return tuple(pts), tuple(zip(thresholds, shares))


def load_profile(name: str) -> LengthProfile:
    """A bundled profile by name (see :func:`profile_names`)."""
    path = os.path.join(DATA_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown profile {name!r}: choose one of {profile_names()} "
                         "(--profile), or give your own --lengths FILE")
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    k = float(obj.get("k", 1024))
    if obj["kind"] == "cumulative":
        points, published = _cumulative_points(obj, k)
    elif obj["kind"] == "mixture":
        points, published = _mixture_points(obj["components"], k), ()
    else:
        raise ValueError(f"{path}: unknown profile kind {obj['kind']!r}")
    return LengthProfile(name=obj["name"], source=obj["source"], points=points,
                         published=published)


def profile_from_lengths(lengths, name: str = "custom", source: str = "user data"
                         ) -> LengthProfile:
    """An empirical profile from observed lengths (``[K]`` ints >= 1)."""
    arr = np.asarray(lengths, dtype=np.int64).ravel()
    return LengthProfile(name=name, source=source, lengths=arr)


def profile_from_file(path: str) -> LengthProfile:
    """An empirical profile from a lengths file (see :func:`skrull_ext.planner.lengths_io.read_lengths`)."""
    name = os.path.splitext(os.path.basename(path))[0]
    return profile_from_lengths(read_lengths(path), name=name, source=path)


def profile_from_megatron(prefix: str) -> LengthProfile:
    """An empirical profile from the sequence lengths of a Megatron ``PREFIX.idx`` dataset."""
    name = os.path.basename(prefix[:-4] if prefix.endswith(".idx") else prefix)
    return profile_from_lengths(read_megatron_idx_lengths(prefix), name=name, source=prefix)


class LengthOverflowError(ValueError):
    """A sampled length exceeds what the configuration can hold (``overflow="error"``)."""

    def __init__(self, count: int, longest: int, max_length: int):
        self.count, self.longest, self.max_length = count, longest, max_length
        super().__init__(
            f"{count} sampled sequence(s) are longer than the longest that fits ({max_length} "
            f"tokens; longest drawn {longest}); allow overflow='truncate' or 'redraw', or raise "
            "the bucket size / CP size")


@dataclasses.dataclass(frozen=True)
class SampledBatches:
    """Global batches drawn from a profile.

    Attributes:
        batches: ``num_batches`` arrays of ``[global_batch_size]`` int64 lengths.
        overflow: How many drawn lengths exceeded ``max_length`` (then truncated or redrawn).
        policy: The overflow policy used.
    """

    batches: tuple[np.ndarray, ...]
    overflow: int
    policy: str


def sample_global_batches(profile: LengthProfile, *, num_batches: int, global_batch_size: int,
                          seed: int = 0, max_length: Optional[int] = None,
                          overflow: str = "error") -> SampledBatches:
    """Draws ``num_batches`` global batches of i.i.d. lengths with one seeded generator.

    Args:
        profile: The length distribution.
        num_batches: Batches to draw (>= 1).
        global_batch_size: Sequences per batch (>= 1).
        seed: Seed of ``numpy.random.default_rng``; the same seed gives the same batches.
        max_length: Longest length the configuration can hold (``None``: no limit).
        overflow: What to do with a draw longer than ``max_length``: ``error`` (raise
            :class:`LengthOverflowError`), ``truncate`` (clip it to ``max_length``, the way
            SFT pipelines cut over-long samples) or ``redraw`` (replace it by a draw from the
            profile conditioned on fitting).  The count is reported either way.

    Returns:
        :class:`SampledBatches`.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if num_batches < 1 or global_batch_size < 1:
        raise ValueError("num_batches and global_batch_size must be >= 1")
    rng = np.random.default_rng(seed)
    batches, count, longest = [], 0, 0
    for _ in range(num_batches):
        lengths = profile.sample(global_batch_size, rng)
        if max_length is not None:
            over = lengths > max_length
            n_over = int(over.sum())
            if n_over:
                count += n_over
                longest = max(longest, int(lengths.max()))
                if overflow == "truncate":
                    lengths[over] = max_length
                elif overflow == "redraw":
                    lengths[over] = profile.sample(n_over, rng, below=max_length + 1)
        batches.append(lengths)
    if count and overflow == "error":
        raise LengthOverflowError(count, longest, int(max_length))
    return SampledBatches(batches=tuple(batches), overflow=count, policy=overflow)


__all__ = ["LengthOverflowError", "LengthProfile", "OVERFLOW_POLICIES", "SampledBatches",
           "load_profile", "profile_from_file", "profile_from_lengths", "profile_from_megatron",
           "profile_names", "sample_global_batches"]
