"""Validates the simulator's ``cpu`` preset: predicted vs measured iteration time.

For a few plans of small global batches (CP = 1, DP = 1, single process: every sequence
runs whole on this process), the tiny model of :mod:`cpu_block` runs forward + backward
over the plan's micro-batches one after another (gradient accumulation, as in training);
the measured time (minimum over repeats) is compared with
``simulate(plan, TINY_SPEC, TINY_CPU).iteration_time`` (the tiny model's constants from
``calibrate_cpu.py``; ``--training-preset`` uses the ``cpu`` preset instead).  The plans come from the bundled
profiles scaled down to CPU sizes and from different policies, so they differ from the
calibration runs of ``calibrate_cpu.py``.  Usage::

    PYTHONPATH=$PWD python benchmarks/validate_cpu_sim.py [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402
from cpu_block import TINY_CPU, TINY_SPEC, TinyModel, best_time  # noqa: E402

from skrull_ext.costmodel.hardware import get_hardware  # noqa: E402
from skrull_ext.planner.profiles import load_profile, sample_global_batches  # noqa: E402
from skrull_ext.scheduler import SchedulerConfig, schedule  # noqa: E402
from skrull_ext.planner.simulator import simulate  # noqa: E402

# (profile, --scale, global batch size, bucket size, policy)
CASES = [
    ("wikipedia", 0.5, 24, 2048, "skrull"),
    ("wikipedia", 0.5, 24, 2048, "per-seq-cp"),
    ("lmsyschat1m", 0.5, 32, 1536, "sorted"),
    ("chatqa2-long-sft", 1 / 16, 12, 4096, "skrull"),
    ("chatqa2-long-sft", 1 / 16, 12, 4096, "kk"),
]


def plan_docs(plan) -> list[list[int]]:
    """Document lengths of each micro-batch of DP rank 0 (CP = 1: one rank holds all)."""
    out = []
    for mb in plan.dp_ranks[0]:
        if not mb.is_empty():
            out.append([int(plan.lengths[i]) for i in mb.samples()])
    return out


def measure_iteration(model: TinyModel, docs: list[list[int]], repeats: int) -> float:
    """Best time of forward + backward over every micro-batch, gradients accumulating."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, model.spec.vocab_size, (sum(d),), generator=gen), d)
               for d in docs]

    def run():
        model.zero_grad(set_to_none=True)
        for tokens, lens in batches:
            model(tokens, lens).backward()

    return best_time(run, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; keep what calibrate_cpu.py used (default 1)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--training-preset", action="store_true",
                        help="predict with the cpu preset (fitted to the launcher's training "
                             "iterations) instead of the tiny model's own constants")
    args = parser.parse_args(argv)
    run = results_io.start()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TinyModel(TINY_SPEC)
    hw = get_hardware("cpu") if args.training_preset else TINY_CPU
    cost = hw.cost_model(TINY_SPEC, 1)
    print(f"{'profile':18} {'scale':>6} {'K':>3} {'bucket':>6} {'policy':11} {'mbs':>4} "
          f"{'tokens':>6} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    errors, rows = [], []
    for name, scale, gbs, bucket, policy in CASES:
        profile = load_profile(name).scaled(scale)
        lengths = sample_global_batches(profile, num_batches=1, global_batch_size=gbs,
                                        seed=args.seed, max_length=bucket,
                                        overflow="truncate").batches[0]
        plan = schedule(lengths, SchedulerConfig(dp_size=1, cp_size=1, bucket_size=bucket,
                                                 policy=policy), cost)
        docs = plan_docs(plan)
        measured = measure_iteration(model, docs, args.repeats)
        predicted = simulate(plan, TINY_SPEC, hw).iteration_time
        err = (predicted - measured) / measured
        errors.append(err)
        rows.append({"profile": name, "scale": scale, "gbs": gbs, "bucket": bucket,
                     "policy": policy, "measured_s": measured, "predicted_s": predicted})
        print(f"{name:18} {scale:6.3g} {gbs:3d} {bucket:6d} {policy:11} {len(docs):4d} "
              f"{int(lengths.sum()):6d} {measured:10.3f} {predicted:11.3f} {100 * err:+6.1f}%")
    errs = np.abs(np.asarray(errors))
    print(f"mean |error| {100 * errs.mean():.1f}%, max |error| {100 * errs.max():.1f}% "
          f"over {len(errors)} plans")
    results_io.record("validate_cpu_sim", rows, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
