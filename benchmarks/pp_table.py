"""Pipeline parallelism in the simulator: PP 1/2/4 for Qwen2.5-7B, Skrull vs all-CP.

32 H100s (``h100`` preset, 80 GiB, 10% margin) split as CP = 8 x DP = 4/P x PP = P, a
global batch of 128 sequences, the same sampled batches for every configuration
(``--num-batches``, default 5, per bundled profile; sequences longer than what PP = 1
fits are redrawn).  Per P the bucket is :func:`skrull_ext.planner.pipeline.pipeline_bucket`
(stage 0 holds P micro-batches in flight under 1F1B).  Each plan is timed by
:func:`~skrull_ext.planner.pipeline.simulate_pipeline` with micro-batches fed in the plan's
order and in the best of the simple orders (``best``); ``bubble`` is the share of the
slowest pipeline's makespan its stages idle.  Usage::

    PYTHONPATH=$PWD python benchmarks/pp_table.py [--num-batches 5] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import results_io

from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import get_model_spec
from skrull_ext.planner.evaluate import max_fitting_length
from skrull_ext.planner.pipeline import pipeline_bucket, simulate_pipeline
from skrull_ext.planner.profiles import load_profile, profile_names, sample_global_batches
from skrull_ext.scheduler import SchedulerConfig, schedule

GIB = float(1 << 30)
GPUS, CP, GLOBAL_BATCH = 32, 8, 128


def run_profile(name: str, model, hw, args) -> list[dict]:
    """Rows of one profile: every P, Skrull and all-CP on the same batches."""
    buckets = {}
    for p in (1, 2, 4):
        buckets[p], _ = pipeline_bucket(model, hw, pp_size=p, optimizer_shards=GPUS // p,
                                        device_bytes=80 * GIB, margin_bytes=8 * GIB)
    limit = max_fitting_length(CP, min(buckets.values()))
    batches = sample_global_batches(load_profile(name), num_batches=args.num_batches,
                                    global_batch_size=GLOBAL_BATCH, seed=args.seed,
                                    max_length=limit, overflow="redraw").batches
    rows = []
    longest = max(int(b.max()) for b in batches)
    for p, bucket in buckets.items():
        dp = GPUS // (CP * p)
        row = {"profile": name, "pp": p, "dp": dp, "bucket": bucket}
        for policy in ("skrull", "all-cp"):
            row.update({f"{policy}_{k}": v for k, v in
                        _policy(policy, batches, bucket, dp, p, model, hw).items()})
        # The memory bucket and 1/2, 1/4, 1/8 of it: more micro-batches, smaller bubble.
        tuned = [(_policy("skrull", batches, bucket >> k, dp, p, model, hw)["best"],
                  bucket >> k) for k in range(4)
                 if max_fitting_length(CP, bucket >> k) >= longest]
        row["skrull_tuned"], row["tuned_bucket"] = min(tuned)
        rows.append(row)
    return rows


def _policy(policy, batches, bucket, dp, pp, model, hw) -> dict:
    """Mean seconds (plan order, best order), bubble share and micro-batches of one policy."""
    cfg = SchedulerConfig(dp_size=dp, cp_size=CP, bucket_size=bucket, policy=policy)
    plans = [schedule(b, cfg, hw.cost_model(model, CP, dp)) for b in batches]
    plain = [simulate_pipeline(pl, model, hw, pp_size=pp) for pl in plans]
    best = [simulate_pipeline(pl, model, hw, pp_size=pp, order="best") for pl in plans]
    return {"plan_order": float(np.mean([r.iteration_time for r in plain])),
            "best": float(np.mean([r.iteration_time for r in best])),
            "bubble": float(np.mean([r.bubble_share for r in best])),
            "mbs": float(np.mean([pl.num_micro_batches for pl in plans]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-batches", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run, recorded = results_io.start(), []
    model, hw = get_model_spec("qwen2.5-7b"), get_hardware("h100")
    start = time.perf_counter()
    print(f"Qwen2.5-7B on {GPUS} H100 (CP={CP}, DP x PP = {GPUS // CP}), global batch "
          f"{GLOBAL_BATCH}, {args.num_batches} batches per profile (seed {args.seed})\n")
    print("| profile | PP | DP | bucket | skrull s (plan order) | skrull s (best order) | "
          "all-cp s (best order) | skrull speedup | micro-batches | bubble | "
          "skrull s, best bucket (bucket) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in profile_names():
        for r in run_profile(name, model, hw, args):
            recorded.append(r)
            print(f"| {r['profile']} | {r['pp']} | {r['dp']} | {r['bucket']} | "
                  f"{r['skrull_plan_order']:.2f} | {r['skrull_best']:.2f} | "
                  f"{r['all-cp_best']:.2f} | {r['all-cp_best'] / r['skrull_best']:.2f}x | "
                  f"{r['skrull_mbs']:.1f} | {100 * r['skrull_bubble']:.1f}% | "
                  f"{r['skrull_tuned']:.2f} ({r['tuned_bucket']}) |")
    print(f"\n({time.perf_counter() - start:.0f} s)")
    results_io.record("pp_table", recorded, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
