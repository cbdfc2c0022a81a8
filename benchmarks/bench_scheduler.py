"""Scheduling latency per global batch: C++ core, full ``schedule()``, Python reference and
Megatron-Core's ``BalancedCPScheduler``, side by side in one run.

For each case (K samples, bucket) on DP=4, CP=8 with long-tail lengths (Pareto, most
samples under 1K tokens, the longest capped at what the bucket holds) it times:

* ``core``: ``skrull_ext._C.portfolio_schedule`` on precomputed cost arrays (GDS plus the
  baselines' groupings and the local-search refinement with the default
  ``--skrull-plan-budget-ms``, the default Skrull policy), conversion to Python lists and
  the flat plan arrays ``schedule()`` asks for included;
* ``schedule()``: the whole call (input checks, cost arrays, core, ``Plan`` building,
  ``Plan.validate()``, prediction and lower bound);
* ``in C++``: the part of ``schedule()`` spent inside C++ calls, all of them (the core
  above and, at CP >= 3, the hybrid-CP candidate's grouping, pricing and check,
  ``_C.hybrid_candidate``); ``schedule()`` / ``in C++`` is what the Python around the
  C++ work costs;
* ``python``: the same ``schedule()`` on the pure-Python reference (small K only);
* ``megatron``: ``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler
  .get_groups_and_subsamples`` with ``max_seq_len_per_rank`` = the bucket over the D x N
  ranks (skipped when megatron-core is not importable).

``--calibrate`` instead times the C++ refinement alone at two budgets and prints the work
units it searches per ms (the basis of ``refine.WORK_UNITS_PER_MS``, which converts
``--skrull-plan-budget-ms`` into a deterministic work budget; ``--stage lns``: the same for
ruin and recreate, ``lns.WORK_UNITS_PER_MS``).

    PYTHONPATH=. python benchmarks/bench_scheduler.py [--cases 256:26000 65536:6000] [--json f]
    PYTHONPATH=. python benchmarks/bench_scheduler.py --calibrate --stat min [--stage lns]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import results_io

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, schedule
from skrull_ext.scheduler.lns import WORK_UNITS_PER_MS as LNS_UNITS_PER_MS
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.refine import WORK_UNITS_PER_MS, budget_work

DP, CP = 4, 8
# The last two: a tight bucket, over a thousand micro-batches per DP rank.
DEFAULT_CASES = ("256:26000", "4096:26000", "65536:26000", "16384:6000", "65536:6000",
                 "16384:2000", "65536:2000")


def long_tail_lengths(k: int, seed: int, max_len: int = 100_000) -> np.ndarray:
    """``[k]`` int64: ``200 * (1 + Pareto(1.1))`` tokens, capped at ``max_len``.

    Median ~380 tokens, ~17% above 1K, a few percent above 10K.
    """
    rng = np.random.default_rng(seed)
    return np.minimum(np.ceil(200.0 * (1.0 + rng.pareto(1.1, k))), max_len).astype(np.int64)


def median_ms(fn, runs: int, cpu: bool = False, stat=statistics.median) -> float:
    """Median (or ``stat``) wall (``cpu``: process CPU) time of ``fn()`` over ``runs`` calls
    (one untimed warm-up), in ms."""
    clock = time.process_time if cpu else time.perf_counter
    fn()
    times = []
    for _ in range(runs):
        start = clock()
        fn()
        times.append(clock() - start)
    return 1e3 * stat(times)


class _TimedCore:
    """``skrull_ext._C`` with every call's wall time added to :attr:`seconds` (a handful
    of calls per ``schedule()``: the portfolio core, the hybrid-CP candidate, ...)."""

    def __init__(self, ext):
        self._ext, self.seconds = ext, 0.0

    def __getattr__(self, name):
        fn = getattr(self._ext, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def in_core_ms(full, runs: int, stat) -> float:
    """``stat`` over ``runs`` calls of ``full()`` of the wall time spent inside C++ calls
    (all of them: the core's and the candidates'), in ms; the rest of ``schedule()`` is
    the Python around them."""
    timed = _TimedCore(_backend.CPP)
    _backend.CPP, saved = timed, _backend.CPP
    try:
        full()
        spent = []
        for _ in range(runs):
            timed.seconds = 0.0
            full()
            spent.append(timed.seconds)
    finally:
        _backend.CPP = saved
    return 1e3 * stat(spent)


def megatron_scheduler(bucket: int):
    """``BalancedCPScheduler.get_groups_and_subsamples`` over D x N ranks, or ``None``."""
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError:
        return None

    class _Group:  # the scheduler only asks the DP x CP group for its size
        def size(self):
            return DP * CP

    sched = BalancedCPScheduler(max_seq_len_per_rank=bucket, dp_cp_group=_Group())
    return lambda lengths: sched.get_groups_and_subsamples(
        [(i, int(s)) for i, s in enumerate(lengths)], None)


def bench_case(k: int, bucket: int, args) -> dict:
    lengths = long_tail_lengths(k, args.seed, min(100_000, CP * bucket - 2 * CP))
    cost_model = default_cost_model()
    costs = cost_model.compute_seconds(lengths)
    comm = cost_model.comm_seconds(lengths, CP)
    shares = cost_model.share_seconds(lengths, CP)
    latency = cost_model.comm_latency(CP)
    cfg = SchedulerConfig(dp_size=DP, cp_size=CP, bucket_size=bucket)
    ext = _backend.CPP
    runs = args.runs if k <= 4096 else max(3, args.runs // 20)
    plan = schedule(lengths, cfg, cost_model, backend="cpp")
    row = {"K": k, "bucket": bucket, "micro_batches": plan.num_micro_batches,
           "predicted_s": plan.predicted["iteration_time"],
           "bound_ratio": plan.predicted["iteration_time"] / plan.predicted["lower_bound"],
           "runs": runs}
    core = lambda: ext.portfolio_schedule(  # noqa: E731
        lengths, costs, comm, latency, DP, CP, bucket, 2, cost_model.micro_batch_overhead, 3,
        shares, objective=objective_arg(objective_of(cost_model)),
        budget=budget_work(cfg.plan_budget_ms, len(lengths)), flat=True)
    full = lambda: schedule(lengths, cfg, cost_model, backend="cpp")  # noqa: E731
    stat = min if args.stat == "min" else statistics.median
    row["core_ms"] = median_ms(core, runs, stat=stat)
    row["schedule_ms"] = median_ms(full, runs, stat=stat)
    row["in_cpp_ms"] = in_core_ms(full, runs, stat)
    # CPU time: what the planning itself costs when other processes share the cores.
    row["core_cpu_ms"] = median_ms(core, runs, cpu=True, stat=stat)
    row["schedule_cpu_ms"] = median_ms(full, runs, cpu=True, stat=stat)
    if k <= args.python_max_k:
        py = schedule(lengths, cfg, cost_model, backend="python")
        if py.dp_ranks != plan.dp_ranks:
            raise SystemExit(f"K={k}: C++ and Python plans differ")
        row["python_ms"] = median_ms(lambda: schedule(lengths, cfg, cost_model,
                                                      backend="python"), 3)
    mega = None if args.skip_megatron else megatron_scheduler(bucket)
    if mega is not None:
        row["megatron_ms"] = median_ms(lambda: mega(lengths), 3 if k > 4096 else 10)
    return row


# --calibrate: (K, bucket) batches and budgets (work units) the refinement is timed on.
CALIBRATE_CASES = ((1024, 26000), (4096, 26000), (4096, 6000), (16384, 26000), (16384, 6000),
                   (16384, 2000), (65536, 26000), (65536, 6000), (65536, 2000))
CALIBRATE_BUDGETS = (150_000, 1_500_000)


def calibrate(args, cases) -> list[dict]:
    """Work units per ms of the C++ refinement (``_C.refine_timing``: the unrefined
    portfolio plan, then ``refine()`` alone, timed in C++), the basis of
    ``refine.WORK_UNITS_PER_MS``; ``stat`` over ``args.runs // 10`` runs (at least 3)."""
    cost_model, rows = default_cost_model(), []
    stat = min if args.stat == "min" else statistics.median
    for k, bucket in cases:
        lengths = long_tail_lengths(k, args.seed, min(100_000, CP * bucket - 2 * CP))
        costs, comm, shares = cost_model.schedule_arrays(lengths, CP)
        for budget in CALIBRATE_BUDGETS:
            timed = [_backend.CPP.refine_timing(
                lengths, costs, comm, cost_model.comm_latency(CP), DP, CP, bucket,
                cost_model.micro_batch_overhead, shares, objective_arg(objective_of(cost_model)),
                budget, args.stage) for _ in range(max(3, args.runs // 10))]
            ms = 1e3 * stat(t for _, t in timed)
            work = timed[0][0]
            rows.append({"K": k, "bucket": bucket, "budget": budget, "work": work, "ms": ms,
                         "units_per_ms": work / ms if ms > 0 else float("nan")})
    return rows


def print_calibration(rows: list[dict], stat: str, stage: str = "refine") -> None:
    """Per batch: each budget's units and ms, then the search's own rate (the slope between
    the two budgets: the units per ms WORK_UNITS_PER_MS stands for) and the fixed set-up
    (pricing the plan once, not counted as work) that the default budget's run adds."""
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    now = WORK_UNITS_PER_MS if stage == "refine" else LNS_UNITS_PER_MS
    print(f"C++ {stage}() alone, {stat} of runs, DP={DP} CP={CP}; now WORK_UNITS_PER_MS = "
          f"{now:,}; load average {load}")
    lo, hi = CALIBRATE_BUDGETS
    print(f"{'K':>6} {'bucket':>7} {'ms @' + format(lo, ','):>12} {'ms @' + format(hi, ','):>14} "
          f"{'units/ms':>9} {'set-up ms':>9}")
    slopes = []
    for a, b in zip(rows[::2], rows[1::2]):
        slope = (b["work"] - a["work"]) / (b["ms"] - a["ms"]) if b["ms"] > a["ms"] else float("nan")
        budget_bound = a["work"] >= a["budget"] and b["work"] >= b["budget"]
        if budget_bound and slope > 0:
            slopes.append(slope)
        print(f"{a['K']:>6} {a['bucket']:>7} {a['ms']:>12.3f} {b['ms']:>14.3f} {slope:>9,.0f} "
              f"{a['ms'] - a['work'] / slope:>9.3f}{'' if budget_bound else ' (converged)'}")
    if slopes:
        print(f"units per ms of search (budget-bound batches): median {statistics.median(slopes):,.0f}"
              f", min {min(slopes):,.0f}, max {max(slopes):,.0f}")


def print_table(rows: list[dict], stat: str = "median") -> None:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"DP={DP} CP={CP}, long-tail lengths, default schedule() (portfolio + refinement, "
          f"ring objective); {stat} wall ms; load average {load} on {os.cpu_count()} CPUs")
    head = (f"{'K':>6} {'bucket':>7} {'M/DP':>5} {'/bound':>7} {'core':>9} {'schedule()':>10} "
            f"{'ratio':>6} {'in C++':>8} {'ratio':>6} {'core CPU':>9} {'sched CPU':>9} "
            f"{'python':>9} {'megatron':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        opt = lambda key: f"{r[key]:>9.2f}" if key in r else f"{'-':>9}"  # noqa: E731
        print(f"{r['K']:>6} {r['bucket']:>7} {r['micro_batches']:>5} {r['bound_ratio']:>7.3f} "
              f"{r['core_ms']:>9.2f} {r['schedule_ms']:>10.2f} "
              f"{r['schedule_ms'] / r['core_ms']:>5.2f}x {r['in_cpp_ms']:>8.2f} "
              f"{r['schedule_ms'] / r['in_cpp_ms']:>5.2f}x {r['core_cpu_ms']:>9.2f} "
              f"{r['schedule_cpu_ms']:>9.2f} {opt('python_ms')} {opt('megatron_ms')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=None,
                        help="K:bucket pairs (global batch size : tokens per CP rank); "
                        f"default {' '.join(DEFAULT_CASES)} (--calibrate: "
                        f"{' '.join(f'{k}:{b}' for k, b in CALIBRATE_CASES)})")
    parser.add_argument("--runs", type=int, default=100,
                        help="timed runs for K <= 4096 (larger K: runs/20, at least 3)")
    parser.add_argument("--python-max-k", type=int, default=4096,
                        help="time the Python reference up to this K")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="the runs' median, or their minimum (on a shared machine the "
                        "least contended run; Python reference and Megatron: median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--calibrate", action="store_true",
                        help="instead: time the refinement alone and print work units per ms "
                        "(the basis of --skrull-plan-budget-ms's conversion)")
    parser.add_argument("--stage", choices=("refine", "lns"), default="refine",
                        help="--calibrate: the local search (refine.WORK_UNITS_PER_MS) or "
                        "ruin and recreate (lns.WORK_UNITS_PER_MS)")
    args = parser.parse_args(argv)
    run = results_io.start()
    try:
        cases = ([tuple(int(x) for x in c.split(":")) for c in args.cases] if args.cases
                 else list(CALIBRATE_CASES) if args.calibrate
                 else [tuple(int(x) for x in c.split(":")) for c in DEFAULT_CASES])
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 2 * CP for c in cases) or args.runs < 1:
        print(f"error: --cases takes K:bucket pairs with K, bucket >= {2 * CP}; --runs >= 1",
              file=sys.stderr)
        return 2
    if _backend.CPP is None:
        print("error: C++ backend unavailable: build it (python setup.py build_ext --inplace) "
              "and unset SKRULL_IMPL=python", file=sys.stderr)
        return 2
    if args.calibrate:
        rows = calibrate(args, cases)
        print_calibration(rows, args.stat, args.stage)
    else:
        rows = [bench_case(k, bucket, args) for k, bucket in cases]
        print_table(rows, args.stat)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    results_io.record("bench_scheduler_calibrate" if args.calibrate else "bench_scheduler",
                      rows, run, argv, stat=args.stat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
