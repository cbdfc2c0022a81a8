"""Does the online cost model follow the machine?  Predicted vs measured iteration time.

Runs the CPU demo (``examples/run_cpu_demo.sh``: 2 gloo ranks, CP = 2, the 128-wide demo
model, its synthetic long-tail corpus) once per seed cost model with
``--skrull-online-cost-model`` on and once with it off, ``--log-interval 1``, and reads
every iteration's ``elapsed time per iteration (ms): X`` and ``predicted (ms): Y`` from
the log.  The prediction
of iteration ``i`` is the one the scheduler planned it with (made before ``i`` ran; with
plan-ahead the refit it used had seen iterations up to ``i - 2``).

Seeds: ``cpu`` (the built-in CPU preset, not fitted to this model), ``h100`` (the GPU
preset: ~3 orders of magnitude too fast here) and ``file`` (the demo's fitted
``examples/configs/tiny_cpu_cost_model.json``).

    python benchmarks/bench_online_cost_model.py --iters 20 --seeds cpu h100

Prints one row per iteration and a summary: median |predicted / measured - 1| over the
iterations after ``--settle`` (default 4), online vs off, per seed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import results_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+) "
                  r".*?predicted \(ms\): ([\d.]+) ")
SEEDS = {"cpu": ("", "--skrull-hardware cpu"), "h100": ("", "--skrull-hardware h100"),
         "file": ("examples/configs/tiny_cpu_cost_model.json", "")}


def run_demo(seed: str, online: bool, iters: int, run_dir: str) -> list[tuple[int, float, float]]:
    """``[(iteration, measured ms, predicted ms)]`` of one demo run."""
    cost_model, extra = SEEDS[seed]
    extra += " --skrull-online-cost-model" if online else ""
    env = dict(os.environ, RUN_DIR=run_dir, ITERS=str(iters), LOG_INTERVAL="1",
               COST_MODEL=cost_model, EXTRA_ARGS=extra.strip())
    proc = subprocess.run(["bash", "examples/run_cpu_demo.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"error: demo run ({seed}, online={online}) failed:\n{proc.stdout[-2000:]}"
                 f"\n{proc.stderr[-2000:]}")
    return [(int(m[1]), float(m[2]), float(m[3])) for m in LINE.finditer(proc.stdout)]


def _load() -> str:
    """The 1/5/15-minute load averages (timings on a shared machine need them)."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--settle", type=int, default=4, help="iterations before the summary")
    ap.add_argument("--seeds", nargs="+", default=["cpu", "h100", "file"], choices=sorted(SEEDS))
    args = ap.parse_args(argv)
    run = results_io.start()
    print(f"load average at start: {_load()}")
    summary, recorded = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            rows = {}
            for online in (False, True):
                rows[online] = run_demo(seed, online, args.iters, os.path.join(tmp, "run"))
            print(f"\nseed {seed}: measured / predicted ms per iteration (online off | on)")
            print(f"{'iter':>5} | {'meas':>8} {'pred':>8} {'err':>7} | {'meas':>8} {'pred':>8}"
                  f" {'err':>7}")
            for (i, m0, p0), (_, m1, p1) in zip(rows[False], rows[True]):
                print(f"{i:5d} | {m0:8.1f} {p0:8.1f} {p0 / m0 - 1:+7.1%} | {m1:8.1f} {p1:8.1f}"
                      f" {p1 / m1 - 1:+7.1%}")
            errs = {on: np.median([abs(p / m - 1) for i, m, p in r if i > args.settle])
                    for on, r in rows.items()}
            summary.append((seed, errs[False], errs[True]))
            recorded.append({"seed": seed, "off": errs[False], "on": errs[True],
                             "iterations": [[i, m0, p0, m1, p1] for (i, m0, p0), (_, m1, p1)
                                            in zip(rows[False], rows[True])]})
    print(f"\nload average at the end: {_load()}")
    print("median |predicted / measured - 1| after iteration", args.settle)
    for seed, off, on in summary:
        print(f"  seed {seed:5s}: online off {off:7.1%} | online on {on:6.1%}")
    results_io.record("bench_online_cost_model", recorded, run, argv, settle=args.settle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
