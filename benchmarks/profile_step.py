"""Where one training step's time goes: ``torch.profiler`` over the launcher's ``run_plan``.

The GPU calibration (``calibrate_gpu.py``) fits a per-micro-batch cost: on one H200 a
micro-batch of four short documents of the Qwen2.5-0.5B shape took 132 ms, of which the
fit gives 90 ms to the micro-batch itself and 34 ms to the iteration (optimizer step), far
more than the kernels' work.  This script profiles such a step (the launcher's model built
in this process, as the calibration does), so the host-side cost can be read op by op:

    python benchmarks/profile_step.py --shape qwen2.5-0.5b --device cuda --docs 4 \\
        --recompute-granularity selective --json profile.json

It prints the busiest ops by self CPU time and by device time, the host-device syncs and
copies, and the step's wall time against the device's busy time; ``--json`` keeps them, as
does ``benchmarks/results/profile_step-<date>.json``.
Runs on ``--device cpu`` with ``--shape tiny`` (the test).  Extra arguments are launcher
flags.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common as gc_  # noqa: E402
import results_io  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item",
            "aten::_local_scalar_dense", "cudaMemcpyAsync", "aten::to", "aten::copy_")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(gc_.SHAPES), default="tiny")
    ap.add_argument("--docs", type=int, default=4, help="the N shortest documents, one step")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-ups)")
    ap.add_argument("--timed-steps", type=int, default=5,
                    help="steps timed without the profiler (after the warm-ups)")
    ap.add_argument("--top", type=int, default=25, help="rows of each table")
    ap.add_argument("--json", help="write the tables here")
    return ap.parse_known_args(argv)


def _rows(events, key: str, top: int) -> list[dict]:
    """The ``top`` events by ``key`` (microseconds), with call counts."""
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
             "device_us": getattr(e, "self_device_time_total", 0.0)} for e in rows]


def profile(trainer, ids, plan, device, steps: int, timed: int = 0) -> dict:
    """Two warm-up steps, ``timed`` steps without the profiler (its overhead per op
    inflates a host-bound step), then ``steps`` profiled ones; op tables and wall times."""
    from torch.profiler import ProfilerActivity

    for _ in range(2):
        trainer.run_plan(ids, plan)
    gc_.sync(device)
    start = time.perf_counter()
    for _ in range(timed):
        trainer.run_plan(ids, plan)
    gc_.sync(device)
    unprofiled = 1e3 * (time.perf_counter() - start) / max(timed, 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            trainer.run_plan(ids, plan)
        gc_.sync(device)
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / steps
    syncs = [{"name": e.key, "calls": e.count / steps, "self_cpu_us": e.self_cpu_time_total / steps}
             for e in events if e.key in SYNC_OPS]
    return {"wall_ms_per_step_profiled": 1e3 * wall, "device_busy_ms_per_step": device_us / 1e3,
            "wall_ms_per_step_unprofiled": unprofiled if timed else None,
            "by_self_cpu": _rows(events, "self_cpu_time_total", 10 ** 6),
            "syncs_per_step": syncs}


def main(argv=None) -> int:
    args, launcher = parse(argv)
    run = results_io.start()
    argv_run = gc_.launcher_argv(args.shape, launcher, seq_length=32768, bucket=32768)
    cfg, trainer, _ = gc_.start_run(argv_run)
    try:
        device = trainer.device
        lengths = trainer.source.lengths
        ids = np.argsort(lengths, kind="stable")[:args.docs]
        plan = gc_.plan_for(lengths[ids], trainer.batch_scheduler.cost_model,
                            cfg.skrull.bucket_size)
        gc_.sync(device)
        t0 = time.perf_counter()
        trainer.run_plan(ids, plan)
        gc_.sync(device)
        first = time.perf_counter() - t0
        out = profile(trainer, ids, plan, device, args.steps, args.timed_steps)
        out.update(environment=gc_.environment(device), docs=int(len(ids)),
                   tokens=int(lengths[ids].sum()), micro_batches=plan.num_micro_batches,
                   first_step_ms=1e3 * first, launcher_flags=argv_run)
    finally:
        trainer = None
        gc_.stop_run()
    top = args.top
    print(f"profile_step: {out['environment']['device']}, {out['docs']} docs, {out['tokens']} "
          f"tokens, {out['micro_batches']} micro-batch(es): {out['wall_ms_per_step_profiled']:.1f}"
          f" ms per step (profiled), device busy {out['device_busy_ms_per_step']:.1f} ms"
          + (f", {out['wall_ms_per_step_unprofiled']:.1f} ms per step unprofiled"
             if out["wall_ms_per_step_unprofiled"] is not None else ""))
    print(f"{'op':60s} {'calls':>8s} {'self CPU ms':>12s} {'device ms':>10s}  (per step)")
    steps = args.steps
    for r in out["by_self_cpu"][:top]:
        print(f"{r['name'][:60]:60s} {r['calls'] / steps:8.1f} {r['self_cpu_us'] / 1e3 / steps:12.2f}"
              f" {r['device_us'] / 1e3 / steps:10.2f}")
    print("host-device syncs and copies per step: " + ", ".join(
        f"{s['name']} x{s['calls']:.0f} ({s['self_cpu_us'] / 1e3:.1f} ms)"
        for s in out["syncs_per_step"]))
    out["by_self_cpu"] = out["by_self_cpu"][:200]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    results_io.record("profile_step", out, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
