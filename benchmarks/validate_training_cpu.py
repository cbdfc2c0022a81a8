"""Validates the ``cpu`` preset on real training iterations: predicted vs measured time.

Global batches of the bundled synthetic long-tail corpus drawn with sampler seeds
:data:`VALIDATION_SEEDS` (the calibration, ``calibrate_training_cpu.py``, used others) are
planned by the launcher's batch scheduler (:func:`megatron.skrull.batch_schedule.build_cost_model`, i.e.
the ``cpu`` preset) with ``skrull``, ``all-cp`` and ``per-seq-cp`` on CP = 2, and each plan
runs as a real training iteration (:mod:`train_harness`: two spawned gloo ranks, median of
interleaved repeats).  For every plan the table compares the measured time with

* the scheduler's prediction (:func:`skrull_ext.scheduler.predict` with the preset's
  :class:`~skrull_ext.costmodel.model.CostModel`: what the scheduler optimises), and
* the simulator's (:func:`skrull_ext.planner.simulator.simulate` with the ``cpu`` preset).

Usage::

    PYTHONPATH=$PWD python benchmarks/validate_training_cpu.py [--model h256|h128] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402
import train_harness as th  # noqa: E402

from skrull_ext.costmodel.hardware import get_hardware  # noqa: E402

VALIDATION_SEEDS = (201, 202, 203, 204)
POLICIES = ("skrull", "all-cp", "per-seq-cp")
SEQ_LENGTH = 16384
BUCKET = 12288


def build_cases(model: str, prefix: str, seeds, global_batches):
    from megatron.skrull.batch_schedule import build_cost_model, model_spec

    argv = th.model_argv(**th.MODELS[model], seq_length=SEQ_LENGTH, global_batch=8,
                         bucket=BUCKET, cp=2, data_path=prefix)
    cfg, source, vocab = th.load_run(argv, 2)
    cost = build_cost_model(cfg, vocab)
    cases, meta = [], []
    for seed in seeds:
        for gb in global_batches:
            ids = th.global_batches(source, gb, seed, 1)[0]
            for policy in POLICIES:
                plan = th.plan_batch(source.lengths[ids], cost, dp=1, cp=2, bucket=BUCKET,
                                     policy=policy)
                cases.append((ids, plan))
                meta.append((seed, gb, policy))
    return argv, model_spec(cfg, vocab), cases, meta


def report(spec, cases, meta, measured) -> tuple[dict, list[dict]]:
    """Prints every plan's measured and predicted times; returns the error summary and one
    row per plan (what ``results_io`` records and docs/costmodel.md renders)."""
    hw = get_hardware("cpu")
    print(f"{'seed':>4} {'gb':>3} {'policy':10} {'tokens':>6} {'max':>6} {'mbs':>3} "
          f"{'local':>5} {'measured':>9} {'scheduler':>9} {'err':>6} {'simulator':>9} {'err':>6}")
    errs, rows = {"scheduler": [], "simulator": []}, []
    for (seed, gb, policy), (_, plan), m in zip(meta, cases, measured):
        cm, sim = th.predictions(plan, spec, hw)
        rows.append({"seed": seed, "global_batch": gb, "policy": policy,
                     "tokens": int(plan.lengths.sum()), "max_length": int(plan.lengths.max()),
                     "micro_batches": plan.num_micro_batches,
                     "local_share": plan.local_token_share(), "measured_ms": 1e3 * m,
                     "scheduler_ms": 1e3 * cm, "simulator_ms": 1e3 * sim})
        errs["scheduler"].append(100 * (cm - m) / m)
        errs["simulator"].append(100 * (sim - m) / m)
        print(f"{seed:4d} {gb:3d} {policy:10} {int(plan.lengths.sum()):6d} "
              f"{int(plan.lengths.max()):6d} {plan.num_micro_batches:3d} "
              f"{100 * plan.local_token_share():4.0f}% {1e3 * m:7.0f}ms {1e3 * cm:7.0f}ms "
              f"{errs['scheduler'][-1]:+5.0f}% {1e3 * sim:7.0f}ms {errs['simulator'][-1]:+5.0f}%")
    summary = {}
    for name, e in errs.items():
        e = np.abs(np.asarray(e))
        summary[name] = (float(e.mean()), float(np.median(e)), float(e.max()))
        print(f"{name:9}: mean |err| {e.mean():.1f}%, median {np.median(e):.1f}%, "
              f"max {e.max():.1f}% over {e.size} plans")
    return summary, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="h256", choices=sorted(th.MODELS))
    ap.add_argument("--quick", action="store_true", help="two seeds, two repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--global-batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--data-dir", help="where the corpus goes (default: a temporary dir)")
    args = ap.parse_args(argv)
    run = results_io.start()
    seeds = VALIDATION_SEEDS[:2] if args.quick else VALIDATION_SEEDS
    repeats = 2 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        prefix = th.make_corpus(args.data_dir or tmp, seq_length=SEQ_LENGTH)
        run_argv, spec, cases, meta = build_cases(args.model, prefix, seeds,
                                                  args.global_batches)
        t0 = time.time()
        res = th.run_cases(run_argv, 2, cases, repeats=repeats)
    print(f"model {args.model} ({spec.hidden_size} hidden, {spec.num_layers} layers, "
          f"{spec.num_attention_heads} heads / {spec.num_query_groups} KV groups), CP 2, "
          f"bucket {BUCKET}; {len(cases)} plans x {repeats} repeats, median; "
          f"{time.time() - t0:.0f} s")
    summary, rows = report(spec, cases, meta, [th.median(t) for t in res["times"]])
    results_io.record("validate_training_cpu", {"summary": {
        name: dict(zip(("mean_abs_pct", "median_abs_pct", "max_abs_pct"), v))
        for name, v in summary.items()}, "cases": rows}, run, argv)


if __name__ == "__main__":
    main()
