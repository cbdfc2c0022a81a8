"""Lookahead windows (``--skrull-lookahead N``) against N = 1: total time and spread.

For every setting (length profile x model x CP x global batch, DP ``--dp-size``, the
planner's recommended bucket) draws ``--iters`` global batches once, then for each N
plans windows of N batches with :func:`skrull_ext.scheduler.lookahead.plan_window` (the
judge: :func:`~skrull_ext.scheduler.lookahead.scheduler_judge` under the hardware preset's
cost model, as in training) and schedules every resulting global batch.  Per N it reports, against N = 1 on the same batches:

* ``pred`` / ``sim``: total iteration time of N = 1 over that of N (> 1: the lookahead
  is faster) under the trained plans (``schedule()`` with its default refinement),
  predicted by the cost model and simulated
  (:func:`skrull_ext.planner.simulator.simulate`, the independent time model);
* ``max/mean`` and ``p90/mean`` of the simulated per-iteration times, and ``max`` the
  slowest simulated iteration over N = 1's slowest;
* ``tok max/mean``: the largest iteration's token count over the mean (the spread of the
  loss normalisers; the same tokens in every N);
* ``judge ms/it``: a window's ``2 N`` judge calls (uncached, measured here) per
  iteration of the window -- training spreads them over the previous window's
  iterations on the plan-ahead worker -- median over windows, and ``/iter`` that over
  the mean predicted iteration time (the machines differ, so it is only a guide).

    PYTHONPATH=. python benchmarks/lookahead.py       # the bundled profiles' grid (~7 min)

The run is recorded in ``benchmarks/results/lookahead-<date>.json`` (``results_io``); its
per-model summary is the table in docs/lookahead.md (``benchmarks/render_tables.py``).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np
import results_io

from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.cli import recommend_bucket
from skrull_ext.planner.evaluate import max_fitting_length
from skrull_ext.planner.profiles import load_profile, profile_names, sample_global_batches
from skrull_ext.planner.simulator import simulate
from skrull_ext.scheduler import SchedulerConfig, schedule
from skrull_ext.scheduler.lookahead import plan_window, scheduler_judge, spread


class CachedScheduler:
    """``schedule()`` of one setting, memoised by the batch's lengths (the same batch
    recurs across N)."""

    def __init__(self, config: SchedulerConfig, cost):
        self.config, self.cost, self._plans = config, cost, {}

    def plan(self, lengths: np.ndarray):
        key = np.ascontiguousarray(lengths, dtype=np.int64).tobytes()
        if key not in self._plans:
            self._plans[key] = schedule(lengths, self.config, self.cost)
        return self._plans[key]


def run_setting(lengths: np.ndarray, gbs: int, windows: list[int], model, hw, dp: int,
                cp: int, bucket: int) -> dict:
    """Every N on the same ``len(lengths) / gbs`` drawn batches (sample id = position):
    windows judged as training judges them, the batches then planned as it plans them."""
    cost = hw.cost_model(model, cp, dp)
    config = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket)
    sched, judge = CachedScheduler(config, cost), scheduler_judge(config, cost)
    drawn = [np.arange(i, i + gbs) for i in range(0, lengths.size, gbs)]
    out = {}
    for n in windows:
        batches, plan_ms, grouped = [], [], 0
        for w in range(0, len(drawn), n):
            start = time.perf_counter()
            win = plan_window(drawn[w:w + n], lengths, judge)
            plan_ms.append(1e3 * (time.perf_counter() - start) / len(win.batches))
            batches += win.batches
            grouped += win.reordered
        plans = [sched.plan(lengths[b]) for b in batches]
        pred = [p.predicted["iteration_time"] for p in plans]
        sim = [simulate(p, model, hw).iteration_time for p in plans]
        tokens = [int(lengths[b].sum()) for b in batches]
        out[n] = {"predicted": spread(pred), "simulated": spread(sim),
                  "tokens_max_over_mean": max(tokens) / float(np.mean(tokens)),
                  "windows_grouped": grouped, "windows": -(-len(drawn) // n),
                  "judge_ms_per_iteration": statistics.median(plan_ms)}
    return out


def _row(n: int, r: dict, base: dict) -> str:
    p, s = r["predicted"], r["simulated"]
    return (f"{n:>2} {base['predicted']['total'] / p['total']:>7.3f} "
            f"{base['simulated']['total'] / s['total']:>7.3f} {s['max_over_mean']:>8.2f} "
            f"{s['p90_over_mean']:>8.2f} {s['max'] / base['simulated']['max']:>6.2f} "
            f"{r['tokens_max_over_mean']:>12.2f} {r['windows_grouped']:>4}/{r['windows']:<3} "
            f"{r['judge_ms_per_iteration']:>11.2f} "
            f"{r['judge_ms_per_iteration'] / (1e3 * p['mean']):>6.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=profile_names())
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_PRESETS))
    parser.add_argument("--cp", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--gbs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--lookahead", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=16, help="global batches per setting")
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run = results_io.start()
    if min(args.lookahead) < 1 or args.iters < 1:
        print("error: --lookahead values and --iters must be >= 1", file=sys.stderr)
        return 2
    hw = get_hardware(args.hardware)
    windows = sorted({1, *args.lookahead})
    print(f"DP={args.dp_size} {hw.name}, {args.iters} global batches per setting; ratios are "
          "N = 1 over N (> 1: faster), spreads of simulated iteration times")
    rows = []
    for pname, mname, cp, gbs in itertools.product(args.profiles, args.models, args.cp,
                                                   args.gbs):
        model = MODEL_PRESETS[mname]
        bucket = max(2 * cp, int(recommend_bucket(model, hw, args.dp_size, cp)))
        lengths = np.concatenate(sample_global_batches(
            load_profile(pname), num_batches=args.iters, global_batch_size=gbs,
            seed=args.seed, max_length=max_fitting_length(cp, bucket),
            overflow="truncate").batches)
        res = run_setting(lengths, gbs, windows, model, hw, args.dp_size, cp, bucket)
        print(f"{pname} {mname} CP {cp} GBS {gbs} bucket {bucket}\n"
              " N    pred     sim max/mean p90/mean    max tok max/mean grouped judge ms/it  /iter")
        for n in windows:
            print(_row(n, res[n], res[1]), flush=True)
        rows.append({"profile": pname, "model": mname, "cp": cp, "gbs": gbs, "bucket": bucket,
                     "dp": args.dp_size, "hardware": hw.name, "iters": args.iters,
                     "seed": args.seed, "by_lookahead": {str(n): res[n] for n in windows}})
    summary = summarize(rows, windows)
    results_io.record("lookahead", {"settings": rows, "summary": summary}, run, argv)
    return 0


def _ratios(rows: list[dict], n: int, key: str) -> list[float]:
    return [r["by_lookahead"]["1"][key]["total"] / r["by_lookahead"][str(n)][key]["total"]
            for r in rows]


def summarize(rows: list[dict], windows: list[int]) -> list[dict]:
    """Per model and N > 1, over its settings: total-time ratios (mean, extremes), mean
    spreads at N = 1 and at N, windows regrouped and the judge's cost; printed and
    returned (what docs/lookahead.md's table shows)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        base = [r["by_lookahead"]["1"] for r in mine]
        for n in windows[1:]:
            at = [r["by_lookahead"][str(n)] for r in mine]
            pred, sim = _ratios(mine, n, "predicted"), _ratios(mine, n, "simulated")
            slowest = [x["simulated"]["max"] / y["simulated"]["max"] for x, y in zip(at, base)]
            cost = [x["judge_ms_per_iteration"] for x in at]
            share = [x["judge_ms_per_iteration"] / (1e3 * x["predicted"]["mean"]) for x in at]
            mean = lambda key, runs: float(np.mean([x["simulated"][key] for x in runs]))  # noqa: E731
            out.append({
                "model": model, "n": n, "settings": len(mine),
                "predicted": [float(np.mean(pred)), min(pred), max(pred)],
                "simulated": [float(np.mean(sim)), min(sim), max(sim)],
                "max_over_mean": [mean("max_over_mean", base), mean("max_over_mean", at)],
                "p90_over_mean": [mean("p90_over_mean", base), mean("p90_over_mean", at)],
                "slowest": [float(np.mean(slowest)), max(slowest)],
                "tokens_max_over_mean": [float(np.mean([x["tokens_max_over_mean"]
                                                         for x in xs])) for xs in (base, at)],
                "windows_grouped": [sum(x["windows_grouped"] for x in at),
                                    sum(x["windows"] for x in at)],
                "judge_ms_per_iteration": [statistics.median(cost), max(cost)],
                "judge_per_iteration_time": [statistics.median(share), max(share)]})
    print("model         N  pred mean (min-max)  sim mean (min-max)  max/mean  tok max/mean")
    for s in out:
        print(f"{s['model']:13} {s['n']:>2}  {s['predicted'][0]:.3f} ({s['predicted'][1]:.3f}-"
              f"{s['predicted'][2]:.3f})  {s['simulated'][0]:.3f} ({s['simulated'][1]:.3f}-"
              f"{s['simulated'][2]:.3f})  {s['max_over_mean'][0]:.2f}->{s['max_over_mean'][1]:.2f}"
              f"  {s['tokens_max_over_mean'][0]:.2f}->{s['tokens_max_over_mean'][1]:.2f}")
    return out


if __name__ == "__main__":
    sys.exit(main())
