"""Scheduling latency per global batch: C++ core vs Python reference.

Times (a) the GDS core alone (``skrull_ext._C.gds_schedule`` vs
``reference.gds_schedule`` on precomputed cost arrays) and (b) the full
``schedule()`` (validation, cost arrays, core, plan building, ``Plan.validate``,
prediction), for the paper's setting (DP=4, CP=8, bucket 26K tokens) on long-tail
lengths: Pareto, most samples under 1K tokens, the longest capped at 100K.

    PYTHONPATH=. python benchmarks/bench_scheduler.py [--sizes 256 65536] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, reference, schedule

DP, CP, BUCKET = 4, 8, 26_000
MAX_LEN = 100_000


def long_tail_lengths(k: int, seed: int) -> np.ndarray:
    """``[k]`` int64: ``200 * (1 + Pareto(1.1))`` tokens, capped at 100K.

    Median ~380 tokens, ~17% above 1K, a few percent above 10K.
    """
    rng = np.random.default_rng(seed)
    return np.minimum(np.ceil(200.0 * (1.0 + rng.pareto(1.1, k))), MAX_LEN).astype(np.int64)


def median_ms(fn, runs: int) -> float:
    """Median wall time of ``fn()`` over ``runs`` calls (one untimed warm-up), in ms."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_size(k: int, args) -> list[dict]:
    lengths = long_tail_lengths(k, args.seed)
    cost_model = default_cost_model()
    costs = cost_model.compute_seconds(lengths)
    comm = cost_model.comm_seconds(lengths, CP)
    latency = cost_model.comm_latency(CP)
    overhead = cost_model.micro_batch_overhead
    cfg = SchedulerConfig(dp_size=DP, cp_size=CP, bucket_size=BUCKET)
    ext = _backend.CPP
    runs_cpp = args.runs if k <= 4096 else max(3, args.runs // 20)
    runs_py = args.runs if k <= 4096 else args.python_runs
    core = {
        "cpp": lambda: ext.gds_schedule(lengths, costs, comm, latency, DP, CP, BUCKET, 2,
                                        overhead),
        "python": lambda: reference.gds_schedule(lengths, costs, comm, latency, DP, CP, BUCKET,
                                                 "auto", overhead),
    }
    full = {b: (lambda b=b: schedule(lengths, cfg, cost_model, backend=b))
            for b in ("cpp", "python")}
    plan_cpp = schedule(lengths, cfg, cost_model, backend="cpp")
    if not args.skip_python:
        same = plan_cpp.dp_ranks == schedule(lengths, cfg, cost_model, backend="python").dp_ranks
        if not same:
            raise SystemExit(f"K={k}: C++ and Python plans differ")
    rows = []
    for part, fns in (("core", core), ("schedule()", full)):
        row = {"K": k, "part": part, "micro_batches": plan_cpp.num_micro_batches,
               "cpp_ms": median_ms(fns["cpp"], runs_cpp), "cpp_runs": runs_cpp}
        if not args.skip_python:
            row["python_ms"] = median_ms(fns["python"], runs_py)
            row["python_runs"] = runs_py
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"DP={DP} CP={CP} bucket={BUCKET}, long-tail lengths (median of runs, wall ms)")
    head = (f"{'K':>7} {'part':<11} {'M':>4} {'C++ ms':>10} {'runs':>5} "
            f"{'Python ms':>11} {'runs':>5} {'speedup':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        py = r.get("python_ms")
        py_cols = (f"{py:>11.3f} {r['python_runs']:>5} {py / r['cpp_ms']:>7.0f}x"
                   if py is not None else f"{'-':>11} {'-':>5} {'-':>8}")
        print(f"{r['K']:>7} {r['part']:<11} {r['micro_batches']:>4} {r['cpp_ms']:>10.3f} "
              f"{r['cpp_runs']:>5} {py_cols}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 65_536],
                        help="global batch sizes K to time")
    parser.add_argument("--runs", type=int, default=200,
                        help="timed runs for small K (C++ large K uses runs/20, at least 3)")
    parser.add_argument("--python-runs", type=int, default=3,
                        help="timed runs of the Python reference for K > 4096")
    parser.add_argument("--skip-python", action="store_true", help="time the C++ core only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.runs < 1 or args.python_runs < 1:
        print("error: --sizes, --runs and --python-runs must be >= 1", file=sys.stderr)
        return 2
    if _backend.CPP is None:
        print("error: C++ backend unavailable: build it (python setup.py build_ext --inplace) "
              "and unset SKRULL_IMPL=python", file=sys.stderr)
        return 2
    rows = [row for k in args.sizes for row in bench_size(k, args)]
    print_table(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
