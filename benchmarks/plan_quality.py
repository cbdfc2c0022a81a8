"""Plan quality: Skrull against every baseline and the lower bound, on the cost model.

For every setting (length profile x model x CP x global batch x bucket), samples global
batches, schedules each with every policy under the *same* cost model (the hardware
preset's, DP ranks fixed by ``--dp-size``) and compares the predicted iteration times
(:func:`skrull_ext.scheduler.predict`): Skrull's ratio to each baseline
(``t_baseline / t_skrull``, >= 1 means Skrull is at least as fast), to the lower bound
(:func:`skrull_ext.scheduler.bound.lower_bound`, and the tighter
:func:`~skrull_ext.scheduler.bound.global_lower_bound`), against a stronger search and
Skrull's planning latency.  The stronger search starts from Skrull's plan: its own local
search run far longer (``--search-budget-ms``), then ``--search-time-s`` seconds per batch
of large-neighbourhood search (``benchmarks/plan_search.py``: ruin and recreate under
simulated annealing, then MILP repairs of a few micro-batches by scipy's HiGHS).  Buckets
are ``--buckets`` multiples of the planner's recommended bucket; sequences longer than
what a bucket holds are truncated (``--overflow truncate``).  The last line is the worst
ratio to any baseline over every batch of every setting.

    PYTHONPATH=. python benchmarks/plan_quality.py                      # bundled profiles
    PYTHONPATH=. python benchmarks/plan_quality.py --lengths my.txt --models qwen2.5-7b
    # issue 31's grid: DP 4, CP 8/16, GBS 64-1024; 0.5B with Megatron's memory defaults
    PYTHONPATH=. python benchmarks/plan_quality.py --cp 8 16 --gbs 64 256 1024 \
        --megatron-defaults qwen2.5-0.5b --json benchmarks/results/plan_quality-DATE.json
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np
import results_io

from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.evaluate import max_fitting_length
from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.planner.cli import recommend_bucket, training_memory
from skrull_ext.planner.profiles import (load_profile, profile_from_file, profile_names,
                                 sample_global_batches)
from skrull_ext.scheduler import DEFAULT_POLICIES, POLICIES, SchedulerConfig, schedule
from skrull_ext.scheduler.bound import global_lower_bound
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS, budget_ms_arg

BASELINES = [p for p in DEFAULT_POLICIES if p != "skrull"]  # --policies may change it


def run_setting(batches, model, hw, dp: int, cp: int, bucket: int, objective: str,
                budget_ms: float = DEFAULT_BUDGET_MS, search_ms: float = 0.0,
                search_s: float = 0.0) -> dict:
    """Every policy on ``batches``; per-batch predicted times, bounds, the stronger
    search's time (``search_ms`` > 0: Skrull's local search with that budget;
    ``search_s`` > 0: then the large-neighbourhood search) and Skrull's latency."""
    cost = dataclasses.replace(hw.cost_model(model, cp, dp), objective=objective)
    times = {p: [] for p in ["skrull"] + BASELINES}
    bounds, tight, searched, latency_ms, mbs = [], [], [], [], []
    for lengths in batches:
        plans = {}
        for policy in times:
            cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket, policy=policy,
                                  plan_budget_ms=budget_ms)
            start = time.perf_counter()
            plan = schedule(lengths, cfg, cost)
            elapsed = time.perf_counter() - start
            times[policy].append(plan.predicted["iteration_time"])
            plans[policy] = plan
            if policy == "skrull":
                latency_ms.append(1e3 * elapsed)
                bounds.append(plan.predicted["lower_bound"])
                mbs.append(plan.num_micro_batches)
                grouped = any(mb.grouped for rank in plan.dp_ranks for mb in rank)
                # A plan with sub-group rings: the bound over plans that may use them too.
                tight.append(global_lower_bound(lengths, cost, dp, cp, bucket, backend="cpp",
                                                subgroups=grouped))
        if search_ms > 0 or search_s > 0:
            stages = _stronger_search(lengths, plans["skrull"], cost, dp, cp, bucket, search_ms,
                                      search_s, max(bounds[-1], tight[-1]))
            searched.append(stages)
    sk = np.array(times["skrull"])
    row = {
        "mean_s": {p: float(np.mean(t)) for p, t in times.items()},
        "ratio": {p: float(np.mean(times[p]) / sk.mean()) for p in BASELINES},
        "worst_batch_ratio": {p: float((np.array(times[p]) / sk).min()) for p in BASELINES},
        "bound_ratio": float(sk.mean() / np.mean(bounds)),
        "global_bound_ratio": float(sk.mean() / np.mean(tight)),
        "latency_ms": statistics.median(latency_ms), "micro_batches": float(np.mean(mbs)),
    }
    if searched:  # >= 1: how much faster the stronger search's plan is (worst batch)
        stages = np.array(searched)  # [batches, 3]: own search, + ruin and recreate, + MILP
        row["search_gain"] = float((sk / stages[:, -1]).max())
        row["refine_gain"] = float((sk / stages[:, 0]).max())
        row["milp_gain"] = float((stages[:, 1] / stages[:, 2]).max())
        row["search_stages_s"] = stages.tolist()
    return row


def _stronger_search(lengths, plan, cost, dp: int, cp: int, bucket: int, search_ms: float,
                     search_s: float, floor_s: float) -> list[float]:
    """Predicted seconds after each stage of the stronger search, each from the previous
    one's best: Skrull's own search with a ``search_ms`` budget (its portfolio pick
    refined much longer), then :mod:`plan_search`'s ruin and recreate and :mod:`plan_milp`'s
    repairs sharing ``search_s`` seconds (stopping at the lower bound ``floor_s``)."""
    best = plan
    if search_ms > 0:
        cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket,
                              plan_budget_ms=search_ms)
        longer = schedule(lengths, cfg, cost)
        if longer.predicted["iteration_time"] < best.predicted["iteration_time"]:
            best = longer
    out = [best.predicted["iteration_time"]]
    if search_s > 0:
        # benchmarks/ modules (scipy for the MILP stage)
        from plan_milp import search as milp_search
        from plan_search import RUIN_SHARE, search

        best = search(best, cost, search_s * RUIN_SHARE, milp=False, floor_s=floor_s)
        out.append(best.predicted["iteration_time"])
        if best.predicted["iteration_time"] > floor_s * (1.0 + 1e-9):
            best = milp_search(best, cost, search_s * (1.0 - RUIN_SHARE))
    out.append(best.predicted["iteration_time"])
    while len(out) < 3:
        out.append(out[-1])
    return out


def bucket_for(args, mname: str, hw, cp: int, factor: float) -> int:
    """``factor`` x the planner's recommended bucket: the paper's memory setting
    (distributed optimizer, selective recompute), or Megatron's defaults (neither) for the
    models in ``--megatron-defaults``."""
    memory = {}
    model = MODEL_PRESETS[mname]
    if mname in args.megatron_defaults or args.megatron_defaults == ["all"]:
        memory["training"] = training_memory(hw, args.dp_size, cp, distributed_optimizer=False,
                                             recompute=None)
    return max(2 * cp, int(factor * recommend_bucket(model, hw, args.dp_size, cp, **memory)))


def settings(args):
    profiles = ([("lengths:" + args.lengths, profile_from_file(args.lengths))] if args.lengths
                else [(name, load_profile(name)) for name in args.profiles])
    for (pname, prof), mname, cp, gbs, factor in itertools.product(
            profiles, args.models, args.cp, args.gbs, args.buckets):
        yield pname, prof, mname, cp, gbs, factor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=profile_names())
    parser.add_argument("--lengths", metavar="FILE", help="a lengths file instead of profiles")
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_PRESETS))
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--gbs", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--buckets", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="multiples of the planner's recommended bucket")
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--objective", choices=("paper", "ring"), default=None,
                        help="the cost model's objective (default: the CostModel default)")
    parser.add_argument("--plan-budget-ms", type=budget_ms_arg, default=DEFAULT_BUDGET_MS,
                        help="skrull's refinement budget (0: portfolio alone)")
    parser.add_argument("--megatron-defaults", nargs="*", default=[], metavar="MODEL",
                        help="models whose bucket follows Megatron's memory defaults (no "
                             "distributed optimizer, no recompute; 'all': every model)")
    parser.add_argument("--search-budget-ms", type=budget_ms_arg, default=300.0,
                        help="the stronger search's first stage: skrull's refinement run "
                             "from its plan with this budget (0: skip)")
    parser.add_argument("--search-time-s", type=float, default=5.0,
                        help="the stronger search's second stage: seconds per batch of "
                             "large-neighbourhood search (benchmarks/plan_search.py; 0: skip)")
    parser.add_argument("--num-batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--policies", nargs="+", choices=POLICIES[1:], default=BASELINES,
                        help="baselines to compare (default all but flexsp, which needs SciPy)")
    parser.add_argument("--flexsp-time-limit", type=float, default=None,
                        help="seconds per micro-batch MILP of the flexsp baseline")
    args = parser.parse_args(argv)
    run = results_io.start()
    BASELINES[:] = args.policies
    if args.flexsp_time_limit is not None:
        from skrull_ext.scheduler import flexsp

        flexsp.TIME_LIMIT_S = args.flexsp_time_limit
    try:
        hw = get_hardware(args.hardware)
        for path in [args.lengths] if args.lengths else []:
            profile_from_file(path)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    objective = args.objective or _default_objective()
    rows = []
    head = (f"{'profile':22} {'model':13} {'CP':>3} {'GBS':>5} {'bucket':>7} {'mbs':>6} "
            + " ".join(f"{p[:9]:>9}" for p in BASELINES)
            + f" {'/bound':>7} {'/global':>7} {'search':>7} {'plan ms':>8}")
    print(f"DP={args.dp_size} {hw.name} objective={objective}: t_policy / t_skrull "
          "(predicted, mean of batches); /bound, /global = t_skrull / lower bound, global "
          "lower bound; search = t_skrull / t_search (worst batch)")
    print(head)
    for pname, prof, mname, cp, gbs, factor in settings(args):
        model = MODEL_PRESETS[mname]
        bucket = bucket_for(args, mname, hw, cp, factor)
        limit = max_fitting_length(cp, bucket)
        batches = sample_global_batches(prof, num_batches=args.num_batches,
                                        global_batch_size=gbs, seed=args.seed,
                                        max_length=limit, overflow="truncate").batches
        row = run_setting(batches, model, hw, args.dp_size, cp, bucket, objective,
                          args.plan_budget_ms, args.search_budget_ms, args.search_time_s)
        row.update(profile=pname, model=mname, cp=cp, gbs=gbs, bucket=bucket, factor=factor)
        rows.append(row)
        print(f"{pname[:22]:22} {mname:13} {cp:>3} {gbs:>5} {bucket:>7} "
              f"{row['micro_batches']:>6.0f} "
              + " ".join(f"{row['ratio'][p]:>9.3f}" for p in BASELINES)
              + f" {row['bound_ratio']:>7.3f} {row['global_bound_ratio']:>7.3f}"
              f" {row.get('search_gain', float('nan')):>7.4f} {row['latency_ms']:>8.2f}",
              flush=True)
    summarize(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": {**results_io.meta("plan_quality", run, argv), "objective": objective,
                                "args": vars(args)}, "rows": rows}, f, indent=1)
    results_io.record("plan_quality", rows, run, argv, objective=objective)
    return 0


def _default_objective() -> str:
    from skrull_ext.costmodel.model import CostModel

    return {f.name: f.default for f in dataclasses.fields(CostModel)}["objective"]


def summarize(rows: list[dict]) -> None:
    big = [r["bound_ratio"] for r in rows if r["gbs"] >= 256]
    losses = sum(1 for r in rows for p in BASELINES if r["ratio"][p] < 1.0)
    print(f"settings {len(rows)}; settings x baselines where skrull is slower: {losses}")
    for p in BASELINES:
        worst = min(rows, key=lambda r: r["worst_batch_ratio"][p])
        print(f"  vs {p:11} mean {np.mean([r['ratio'][p] for r in rows]):.3f}x, worst batch "
              f"{worst['worst_batch_ratio'][p]:.4f}x ({worst['profile']}, {worst['model']}, "
              f"CP {worst['cp']}, GBS {worst['gbs']}, bucket {worst['bucket']})")
    print(f"  skrull / bound: mean {np.mean([r['bound_ratio'] for r in rows]):.3f}, "
          f"GBS >= 256 mean {np.mean(big) if big else float('nan'):.3f}, "
          f"max {max(r['bound_ratio'] for r in rows):.3f}")
    tight = [r["global_bound_ratio"] for r in rows if r["gbs"] >= 256]
    print(f"  skrull / global bound: mean "
          f"{np.mean([r['global_bound_ratio'] for r in rows]):.3f}, GBS >= 256 mean "
          f"{np.mean(tight) if tight else float('nan'):.3f}, "
          f"max {max(r['global_bound_ratio'] for r in rows):.3f}")
    gains = [r for r in rows if "search_gain" in r]
    if gains:
        print(f"  skrull's own search with --search-budget-ms: faster by > 1% in "
              f"{sum(r['refine_gain'] > 1.01 for r in gains)} settings, most "
              f"{max(r['refine_gain'] for r in gains):.4f}x; the MILP repairs improved "
              f"{sum(r['milp_gain'] > 1.0 for r in gains)} settings' plans, most "
              f"{max(r['milp_gain'] for r in gains):.4f}x")
        top = max(gains, key=lambda r: r["search_gain"])
        print(f"  stronger search: faster than skrull by > 1% in "
              f"{sum(r['search_gain'] > 1.01 for r in gains)} of {len(gains)} settings, "
              f"most {top['search_gain']:.4f}x ({top['profile']}, {top['model']}, "
              f"CP {top['cp']}, GBS {top['gbs']}, bucket {top['bucket']})")
    worst = min(r["worst_batch_ratio"][p] for r in rows for p in BASELINES)
    print(f"worst ratio to any baseline: {worst:.4f}")


if __name__ == "__main__":
    sys.exit(main())
