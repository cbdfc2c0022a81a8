"""One time model: the scheduler's prediction against the planner's simulator, plan by plan.

For the settings of ``benchmarks/plan_quality.py`` (same flags), every policy's plan of a
sampled batch is priced twice, by :func:`skrull_ext.scheduler.predict` (what the scheduler
minimises) and by :func:`skrull_ext.planner.simulator.simulate` (what the planner reports),
both from the hardware preset's cost model.  Per setting it prints ``predict / simulate`` of
every policy and the policy pairs the two rank in opposite orders (ignoring pairs the
simulator times within ``--tie`` of each other); the summary gives the extremes of the
ratio over every plan and the number of opposite rankings (docs/scheduler.md, "One time
model", says which terms remain different).

    PYTHONPATH=. python benchmarks/time_models.py --gbs 64 256 1024
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_quality as pq  # noqa: E402  (the same settings and batches)

from skrull_ext.costmodel.hardware import get_hardware  # noqa: E402
from skrull_ext.costmodel.model import MODEL_PRESETS  # noqa: E402
from skrull_ext.planner.cli import recommend_bucket  # noqa: E402
from skrull_ext.planner.evaluate import max_fitting_length  # noqa: E402
from skrull_ext.planner.profiles import sample_global_batches  # noqa: E402
from skrull_ext.planner.simulator import simulate  # noqa: E402
from skrull_ext.scheduler import DEFAULT_POLICIES, SchedulerConfig, schedule  # noqa: E402


def compare(lengths, model, hw, dp: int, cp: int, bucket: int, objective: str, policies,
            tie: float) -> dict:
    """Per policy ``(predicted, simulated)`` seconds of one batch, and the flipped pairs."""
    cost = dataclasses.replace(hw.cost_model(model, cp, dp), objective=objective)
    out = {}
    for policy in policies:
        plan = schedule(lengths, SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket,
                                                 policy=policy), cost)
        out[policy] = (plan.predicted["iteration_time"],
                       simulate(plan, model, hw).iteration_time)
    flips = [(a, b) for a, b in itertools.combinations(policies, 2)
             if abs(out[a][1] - out[b][1]) > tie * max(out[a][1], out[b][1])
             and (out[a][0] - out[b][0]) * (out[a][1] - out[b][1]) < 0]
    return {"times": out, "flips": flips}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=pq.profile_names())
    parser.add_argument("--lengths", metavar="FILE", help="a lengths file instead of profiles")
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_PRESETS))
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--gbs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--buckets", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--dp-size", type=int, default=4)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--objective", choices=("paper", "ring"), default="ring")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--tie", type=float, default=1e-3,
                        help="relative simulated difference below which a pair is a tie")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    hw = get_hardware(args.hardware)
    rows, ratios, flips = [], [], 0
    print(f"DP={args.dp_size} {hw.name} objective={args.objective}: predict / simulate per "
          "policy; flips = policy pairs ranked in opposite orders")
    for pname, prof, mname, cp, gbs, factor in pq.settings(argparse.Namespace(
            lengths=args.lengths, profiles=args.profiles, models=args.models, cp=args.cp,
            gbs=args.gbs, buckets=args.buckets)):
        model = MODEL_PRESETS[mname]
        bucket = max(2 * cp, int(factor * recommend_bucket(model, hw, args.dp_size, cp)))
        (lengths,) = sample_global_batches(
            prof, num_batches=1, global_batch_size=gbs, seed=args.seed,
            max_length=max_fitting_length(cp, bucket), overflow="truncate").batches
        got = compare(lengths, model, hw, args.dp_size, cp, bucket, args.objective,
                      args.policies, args.tie)
        r = {p: t[0] / t[1] for p, t in got["times"].items()}
        ratios.extend(r.values())
        flips += len(got["flips"])
        rows.append({"profile": pname, "model": mname, "cp": cp, "gbs": gbs, "bucket": bucket,
                     "times": got["times"], "flips": got["flips"]})
        print(f"{pname[:18]:18} {mname:13} CP {cp:>2} GBS {gbs:>4} bucket {bucket:>6} "
              + " ".join(f"{p[:6]}:{x:.3f}" for p, x in r.items())
              + (f"  flips {got['flips']}" if got["flips"] else ""), flush=True)
    a = np.array(ratios)
    print(f"plans {a.size}: predict / simulate min {a.min():.4f} max {a.max():.4f} "
          f"mean |1 - r| {np.abs(1 - a).mean():.4f}; opposite rankings {flips}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
