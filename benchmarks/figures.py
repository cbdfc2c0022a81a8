"""Draws the docs' figures into ``docs/img/`` (small PNGs, redrawn by running this script).

* ``plan.png``: Skrull's plan of one global batch (64 sequences drawn from the published
  ChatQA2-Long-SFT length profile, Qwen2.5-0.5B on DP 2 x CP 8 H100s, the memory model's
  bucket): per DP rank and micro-batch the tokens on each CP rank, distributed sequences
  (zigzag-sharded over all CP ranks) and local ones (whole on one CP rank), and next to it
  every sequence's length by placement.
* ``speedup.png``: the simulator's speedup of Skrull over each baseline on the paper's six
  settings, from the newest ``benchmarks/results/paper_table-*.json``.
* ``memory.png``: the memory model's bucket choice: per model and memory setting, what an
  80 GB H100 holds (static state, activations of one bucket, margin) and the bucket it gives.

    PYTHONPATH=$PWD python benchmarks/figures.py [--only plan speedup memory]

matplotlib (a dependency of the project, imported only here and by ``skrull-plan --plot``).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import render_tables  # noqa: E402

from skrull_ext.costmodel.hardware import get_hardware  # noqa: E402
from skrull_ext.costmodel.model import get_model_spec  # noqa: E402
from skrull_ext.planner.cli import memory_bucket, training_memory  # noqa: E402
from skrull_ext.planner.evaluate import max_fitting_length  # noqa: E402
from skrull_ext.planner.profiles import load_profile, sample_global_batches  # noqa: E402
from skrull_ext.scheduler import SchedulerConfig, schedule  # noqa: E402
from skrull_ext.sharding import shard_tokens  # noqa: E402

OUT = os.path.join(render_tables.ROOT, "docs", "img")
DIST, LOCAL = "#dd8452", "#55a868"
GIB = float(1 << 30)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9})
    return plt


def plan_figure(path: str) -> None:
    """One global batch's plan, per DP rank x micro-batch, and lengths by placement."""
    plt = _pyplot()
    model, hw, dp, cp = get_model_spec("qwen2.5-0.5b"), get_hardware("h100"), 2, 8
    bucket = memory_bucket(model, hw, dp, cp, device_gb=80)
    lengths = sample_global_batches(load_profile("chatqa2-long-sft"), num_batches=1,
                                    global_batch_size=64, seed=0,
                                    max_length=max_fitting_length(cp, bucket),
                                    overflow="truncate").batches[0]
    plan = schedule(lengths, SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket),
                    hw.cost_model(model, cp, dp))
    mbs = plan.num_micro_batches
    fig = plt.figure(figsize=(10, 4.6))
    grid = fig.add_gridspec(dp, mbs + 1, width_ratios=[1] * mbs + [0.9])
    placed = {}
    for d, rank in enumerate(plan.dp_ranks):
        for m, mb in enumerate(rank):
            ax = fig.add_subplot(grid[d, m])
            base = np.zeros(cp)
            for i in mb.distributed:
                share = shard_tokens(int(lengths[i]), cp)
                ax.bar(range(cp), share, bottom=base, color=DIST, edgecolor="k", linewidth=0.3)
                base += share
                placed[i] = "distributed"
            for r, samples in enumerate(mb.local):
                for i in samples:
                    ax.bar(r, lengths[i], bottom=base[r], color=LOCAL, edgecolor="w",
                           linewidth=0.4)
                    base[r] += lengths[i]
                    placed[i] = "local"
            ax.axhline(bucket, color="k", ls="--", lw=0.8)
            ax.set_ylim(0, bucket * 1.08)
            ax.set_xticks(range(cp))
            ax.set_title(f"DP rank {d}, micro-batch {m}: {len(mb.distributed)} distributed, "
                         f"{sum(map(len, mb.local))} local", fontsize=8)
            ax.set_xlabel("CP rank" if d == dp - 1 else "")
            ax.set_ylabel("tokens" if m == 0 else "")
    ax = fig.add_subplot(grid[:, mbs])
    for k, (kind, color) in enumerate((("local", LOCAL), ("distributed", DIST))):
        ls = [lengths[i] for i, p in placed.items() if p == kind]
        ax.scatter(np.full(len(ls), k) + np.random.default_rng(k).uniform(-0.2, 0.2, len(ls)),
                   ls, s=10, color=color)
    ax.set_yscale("log")
    ax.set_xticks([0, 1], ["local", "distributed"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylabel("sequence length (tokens)")
    ax.set_title("each sequence", fontsize=8)
    fig.suptitle(f"Skrull's plan of one global batch: 64 sequences (ChatQA2-Long-SFT lengths), "
                 f"Qwen2.5-0.5B, DP {dp} x CP {cp} H100\nbucket {bucket:,} tokens per CP rank "
                 f"(dashed); orange: zigzag-sharded over all CP ranks, green: whole on one rank "
                 f"({100 * plan.local_token_share():.0f}% of tokens)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def speedup_figure(path: str) -> None:
    """Skrull's simulated speedup over each baseline, per setting of the paper."""
    plt = _pyplot()
    run = render_tables.current("paper_table", render_tables.per_setting)
    rows, baselines = run["rows"], ["all-cp", "sorted", "kk", "hybrid-cp"]
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    width = 0.8 / len(baselines)
    x = np.arange(len(rows))
    for j, p in enumerate(baselines):
        ax.bar(x + (j - 1.5) * width, [r["speedup"][p] for r in rows], width, label=f"over {p}")
    top = max(r["speedup"][p] for r in rows for p in baselines)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylim(0.8, top + 0.25)
    ax.set_xticks(x, [f"{r['model'].replace('qwen2.5-', '').upper()} {r['dataset']}\n"
                      f"DP {r['dp']} x CP {r['cp']}\n(per-seq-cp: "
                      f"{r['speedup']['per-seq-cp']:.1f}x)" for r in rows])
    ax.set_ylabel("simulated speedup of Skrull")
    ax.legend(ncol=4, fontsize=7, loc="upper right")
    ax.set_title(f"Skrull vs the baselines, the paper's settings, H100 preset "
                 f"(simulator, {run['meta'].get('date_utc', '')[:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MEMORY_SETTINGS = [  # label, model, training flags
    ("0.5B", "qwen2.5-0.5b", {}),
    ("7B, distributed optimizer\n+ selective recompute", "qwen2.5-7b", {}),
    ("7B, + full recompute", "qwen2.5-7b", {"recompute": "full"}),
    ("7B, Megatron defaults\n(neither)", "qwen2.5-7b",
     {"distributed_optimizer": False, "recompute": None}),
]


def memory_figure(path: str) -> None:
    """Per setting: static state, one bucket's activations and the margin on 80 GB."""
    plt = _pyplot()
    hw, dp, cp, device = get_hardware("h100"), 4, 8, 80.0
    fig, ax = plt.subplots(figsize=(8, 3.4))
    parts = ["params", "grads", "main_params", "optimizer_state"]
    colors = ["#4c72b0", "#8172b3", "#937860", "#da8bc3", LOCAL, "#cccccc"]
    right = device
    for y, (label, name, flags) in enumerate(MEMORY_SETTINGS):
        model, training = get_model_spec(name), training_memory(hw, dp, cp, **flags)
        static = training.static_breakdown(model)
        try:
            bucket = memory_bucket(model, hw, dp, cp, device_gb=device, training=training)
        except ValueError:
            bucket = 0
        sizes = [static[p] / GIB for p in parts]
        sizes += [bucket * training.activation_bytes_per_token(model) / GIB, 0.1 * device]
        left = 0.0
        names = ["parameters", "gradients", "fp32 main params", "Adam", "activations",
                 "margin"]
        for size, color, part in zip(sizes, colors, names):
            ax.barh(y, size, left=left, color=color, label=part if y == 0 else None)
            left += size
        right = max(right, left)
        ax.text(left + 1, y, f"bucket {bucket:,} tokens" if bucket else
                "static state + margin\nexceed the GPU: no bucket", va="center", fontsize=8)
    ax.axvline(device, color="k", lw=0.8)
    ax.set_yticks(range(len(MEMORY_SETTINGS)), [s[0] for s in MEMORY_SETTINGS])
    ax.invert_yaxis()
    ax.set_xlim(0, right * 1.4)
    ax.set_xlabel("GiB per GPU (bf16, DP 4 x CP 8, 80 GB H100)")
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.45, -0.22))
    ax.set_title("The memory model's bucket: tokens per CP rank that fit after the static "
                 "state and the margin")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


FIGURES = {"plan": plan_figure, "speedup": speedup_figure, "memory": memory_figure}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(FIGURES), default=list(FIGURES))
    ap.add_argument("--out", default=OUT, help="directory (default: docs/img)")
    args = ap.parse_args(argv)
    try:
        _pyplot()
    except ImportError:
        print("error: matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for name in args.only:
        path = os.path.join(args.out, f"{name}.png")
        FIGURES[name](path)
        print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path) // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
