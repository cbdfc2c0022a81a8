"""Planner figure: length histogram, per-policy iteration time, per-rank timeline.

matplotlib is imported lazily with the non-interactive ``Agg`` backend, so importing
:mod:`skrull_ext` never needs a display.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from skrull_ext.planner.simulator import SimResult

COLORS = {
    "overhead": "#9e9e9e",
    "linear": "#4c72b0",
    "attention_local": "#55a868",
    "attention_dist": "#dd8452",
    "comm_exposed": "#c44e52",
    "idle": "#f0f0f0",
    "grad_reduce": "#8172b3",
}
MAX_TIMELINE_ROWS = 64


def _histogram(ax, lengths: np.ndarray, bucket: int, max_len: int):
    lo = max(int(lengths.min()), 1)
    hi = max(int(lengths.max()), lo + 1)
    bins = np.logspace(np.log10(lo), np.log10(hi) + 1e-9, 40)
    ax.hist(lengths, bins=bins, color="#4c72b0")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(bucket, color="#55a868", ls="--", label=f"bucket {bucket}")
    ax.axvline(max_len, color="#c44e52", ls="--", label=f"longest that fits {max_len}")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("sequences")
    ax.set_title(f"sampled lengths ({lengths.size} sequences)")
    ax.legend(fontsize=7)


def _policies(ax, comparison):
    names = list(comparison.stats)
    times = [comparison.stats[p].mean_time * 1e3 for p in names]
    bound = float(comparison.stats[names[0]].lower_bounds.mean()) * 1e3
    ax.barh(names, times, color=["#dd8452" if p == "skrull" else "#4c72b0" for p in names])
    ax.axvline(bound, color="k", ls=":", label=f"lower bound {bound:.1f} ms")
    for y, t in enumerate(times):
        ax.text(t, y, f" {t:.1f}", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("mean simulated iteration time (ms)")
    ax.set_title("policies")
    ax.legend(fontsize=7)


def _timeline(ax, result: SimResult):
    d_size, _, n_size = result.linear.shape
    rows = 0
    for d in range(d_size):
        if rows >= MAX_TIMELINE_ROWS:
            break
        for seg in result.segments(d):
            y = d * n_size + seg["cp_rank"]
            if y >= MAX_TIMELINE_ROWS:
                continue
            ax.barh(y, seg["duration"] * 1e3, left=seg["start"] * 1e3, height=0.8,
                    color=COLORS[seg["kind"]], linewidth=0)
        for start in result.mb_starts[d]:
            ax.plot([start * 1e3] * 2, [d * n_size - 0.5, (d + 1) * n_size - 0.5], color="k",
                    lw=0.4)
        rows += n_size
    shown = min(rows, MAX_TIMELINE_ROWS)
    ax.set_ylim(shown - 0.5, -0.5)
    ax.set_ylabel("rank (DP x CP + CP)" + ("" if shown == d_size * n_size else " (first rows)"))
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{result.policy}: one global batch, {result.iteration_time * 1e3:.1f} ms")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    ax.legend(handles=handles, fontsize=6, loc="lower right")


def plot_planner(path: str, lengths: Sequence[np.ndarray], comparison, result: SimResult,
                 bucket: int, max_len: int, title: str) -> None:
    """Writes the planner figure to ``path`` (format from the suffix, e.g. ``.png``).

    Args:
        path: Output file.
        lengths: Sampled global batches (``[K]`` arrays), for the histogram.
        comparison: :class:`skrull_ext.planner.evaluate.Comparison` of the policies.
        result: The simulation whose timeline is drawn (one global batch).
        bucket: Bucket size (tokens per rank per micro-batch).
        max_len: Longest sequence that fits.
        title: Figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(13, 8))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.6])
    _histogram(fig.add_subplot(grid[0, 0]), np.concatenate(list(lengths)), bucket, max_len)
    _policies(fig.add_subplot(grid[0, 1]), comparison)
    _timeline(fig.add_subplot(grid[1, :]), result)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["plot_planner"]
