"""End-to-end training benchmark on CPU: ``skrull`` vs ``all-cp`` vs ``per-seq-cp`` (CP = 2).

The same data (the bundled synthetic long-tail SFT corpus of ``tools/preprocess_sft.py
--synthetic``: longest sample 16K tokens, ~80% under 512), model and sampler seed for every
policy: iteration ``i`` trains the same global batch under each policy.  Two spawned gloo
ranks (:mod:`train_harness`, the launcher's ``setup`` and ``Trainer``; one thread each as
under torchrun) train, in every *pass*, one policy's iterations in order (the ``--warmup``
iterations first, unmeasured), then the next policy's, so each measured iteration follows
the same policy's previous one, as in training; each iteration is planned by the launcher's
batch scheduler (``--skrull-scheduler <policy>``, the cost model below; planning is timed)
and then runs forward/backward, the gradient all-reduce, clipping and AdamW
(:meth:`Trainer.run_plan`).

Timing method (the same for every policy): the order of the policies' blocks rotates by
one from pass to pass (``A B C``, ``B C A``, ...), so machine drift within a pass hits
each policy in every position.  The first ``--warmup-passes`` passes (default 1) are not
measured: before anything is timed, every policy has run every measured batch -- the
largest shapes included -- so one-time costs (allocator growth to the largest
activations, the kernels' and autograd's first calls on new shapes, page faults of fresh
memory, the first P2P exchanges of a size) are paid outside the measurement by all
policies alike.  Then every case runs ``--repeats`` more times, in separate passes; its
median is its time, and a policy's total is the sum of its medians over the measured
iterations.  Because the machine's speed drifts between passes (other processes), the
per-pass totals and their ratios to the reference are printed too: a ratio on both sides
of 1.00 in different passes is within the noise.  (Why policy-major:
:func:`schedule_cases`.)
Printed: per policy the median iteration time over the measured iterations and the total
time, each with its ratio to ``skrull``, tokens kept local, micro-batches, the scheduler's
predicted time (median), and the time split summed over the iterations (rank 0; see
:data:`train_harness.PARTS`); then the per-iteration times and the per-pass totals.
Usage::

    PYTHONPATH=$PWD python benchmarks/bench_e2e_cpu.py [--iters 8] [--warmup 1]
        [--warmup-passes 1] [--repeats 3]
        [--model h256] [--global-batch-size 32] [--bucket 12288] [--seed 1]
        [--policies skrull all-cp per-seq-cp hybrid-cp ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402
import train_harness as th  # noqa: E402

POLICIES = ("skrull", "all-cp", "per-seq-cp")
SEQ_LENGTH = 16384


def build(args, prefix):
    """``(argv, batches, plans)``: the run's flags, global batches and each policy's plans."""
    from megatron.skrull.batch_schedule import make_batch_scheduler

    extra = ["--skrull-cost-model-config", args.cost_model_config] \
        if args.cost_model_config else []
    argv = th.model_argv(**th.MODELS[args.model], seq_length=SEQ_LENGTH,
                         global_batch=args.global_batch_size, bucket=args.bucket, cp=2,
                         data_path=prefix, extra=extra)
    cfg, source, vocab = th.load_run(argv, 2)
    batches = th.global_batches(source, args.global_batch_size, args.seed,
                                args.warmup + args.iters)
    plans = {}
    for policy in args.policies:
        run = dataclasses.replace(cfg, skrull=dataclasses.replace(cfg.skrull, scheduler=policy))
        batch_scheduler = make_batch_scheduler(run, vocab)
        plans[policy] = [batch_scheduler(source.lengths[ids]) for ids in batches]
    return argv, batches, plans


def schedule_cases(batches, start: int, policies=POLICIES, shift: int = 0):
    """``[(iteration, policy)]`` from ``start``: each policy's batches in training order,
    one policy after another, the policies rotated by ``shift`` (a pass with another
    ``shift`` runs each policy's block elsewhere in the pass).

    Policy-major, not iteration-major: a case's predecessor is the same policy's previous
    iteration, as in a training run.  (Interleaving the policies within an iteration, even
    with the rotation shifted per pass, keeps every policy behind the same other policy --
    a rotation preserves the cyclic order -- and the switch between two policies' plans,
    whose tensors have other shapes, cost one of them more: skrull's iteration 1 measured
    7-13% above all-cp's behind ``sorted`` in four runs, 4-79% below it, pass by pass,
    when only the two alternated.)
    """
    k = shift % len(policies)
    return [(i, p) for p in policies[k:] + policies[:k] for i in range(start, len(batches))]


def run_passes(run_argv, batches, policies, args) -> tuple[list, dict]:
    """Runs the warm-up and measured passes, each in its own rotation; returns
    ``(order, {"times": [case][pass], "parts": [case][pass]})`` over the measured passes,
    ``order`` the first measured pass's ``[(iteration, policy)]``."""
    passes = [schedule_cases(batches, 0, policies, shift=r)
              for r in range(args.warmup_passes + args.repeats)]
    flat = [c for order in passes for c in order]
    res = th.run_cases(run_argv, 2, [(batches[i], p) for i, p in flat], repeats=1, warmup=0,
                       breakdown=not args.no_breakdown)
    at = {}  # (iteration, policy) -> its runs, pass by pass
    for (case, t, parts) in zip(flat, res["times"], res["parts"] or [[]] * len(flat)):
        at.setdefault(case, []).append((t[0], parts[0] if parts else None))
    order = passes[min(args.warmup_passes, len(passes) - 1)]
    runs = [at[c][args.warmup_passes:] for c in order]
    breakdown = any(p is not None for r in runs for _, p in r)
    return order, {"times": [[t for t, _ in r] for r in runs],
                   "parts": [[p for _, p in r] for r in runs] if breakdown else []}


def summarize(order, times, parts, plans, first: int):
    """Per-policy medians over the measured iterations (``>= first``)."""
    rows = {}
    for p in plans:
        idx = [j for j, (i, q) in enumerate(order) if q == p and i >= first]
        its = [order[j][0] for j in idx]
        secs = [times[j] for j in idx]
        split = {k: float(np.sum([parts[j][k] for j in idx])) for k in th.PARTS} \
            if parts else {}
        rows[p] = dict(seconds=float(np.median(secs)), per_iter=dict(zip(its, secs)),
                       local=float(np.mean([plans[p][i].local_token_share() for i in its])),
                       mbs=float(np.mean([plans[p][i].num_micro_batches for i in its])),
                       predicted=float(np.median([plans[p][i].predicted["iteration_time"]
                                                  for i in its])),
                       split=split)
    return rows


def print_tables(rows, plans, first):
    """The summary, the time split and the per-iteration table; ratios vs the first policy."""
    ref = next(iter(rows))
    base = rows[ref]["seconds"]
    total = {p: sum(r["per_iter"].values()) for p, r in rows.items()}
    vs = f"vs {ref}"
    print(f"{'policy':11} {'median iter':>11} {vs:>9} {'total':>8} {vs:>9} "
          f"{'local tok':>9} {'micro-b':>7} {'predicted':>9}")
    for p, r in rows.items():
        print(f"{p:11} {1e3 * r['seconds']:9.0f}ms {r['seconds'] / base:8.2f}x "
              f"{total[p]:7.1f}s {total[p] / total[ref]:8.2f}x "
              f"{100 * r['local']:8.1f}% {r['mbs']:7.1f} {1e3 * r['predicted']:7.0f}ms")
    if rows[ref]["split"]:
        print("\ntime split, summed over the measured iterations (rank 0, seconds):")
        print(f"{'policy':11} " + " ".join(f"{k:>10}" for k in th.PARTS) + f" {'total':>8}")
        for p, r in rows.items():
            print(f"{p:11} " + " ".join(f"{r['split'][k]:10.2f}" for k in th.PARTS)
                  + f" {sum(r['split'].values()):8.2f}")
    print("\nper iteration, measured / predicted (ms):")
    print(f"{'iter':>4} {'tokens':>6} {'max len':>7} " + " ".join(f"{p:>15}" for p in rows)
          + f"  {ref} local / mbs")
    for i in sorted(rows[ref]["per_iter"]):
        plan = plans[ref][i]
        cells = [f"{1e3 * rows[p]['per_iter'][i]:7.0f}/"
                 f"{1e3 * plans[p][i].predicted['iteration_time']:<7.0f}" for p in rows]
        print(f"{i:4d} {int(plan.lengths.sum()):6d} {int(plan.lengths.max()):7d} "
              + " ".join(cells) + f"  {100 * plan.local_token_share():4.0f}% / "
              f"{plan.num_micro_batches}")


def pass_totals(order, times, policies, first: int) -> dict:
    """Per policy, each measured pass's total over the measured iterations (s)."""
    passes = len(times[0]) if times else 0
    return {p: [sum(times[j][r] for j, (i, q) in enumerate(order) if q == p and i >= first)
                for r in range(passes)] for p in policies}


def print_passes(order, times, policies, first: int):
    """Each measured pass's total per policy and its ratio to the first policy's."""
    totals = pass_totals(order, times, policies, first)
    passes = len(totals[policies[0]])
    ref = policies[0]
    print(f"\nper measured pass, total (s) and / {ref}'s:")
    print(f"{'pass':>4} " + " ".join(f"{p:>17}" for p in policies))
    for r in range(passes):
        print(f"{r + 1:4d} " + " ".join(
            f"{totals[p][r]:8.1f} ({totals[p][r] / totals[ref][r]:.2f}x)" for p in policies))


def result_rows(order, times, rows, plans, first: int) -> dict:
    """The recorded numbers: per policy the summary and each measured pass's total / the
    first policy's; per iteration its tokens, longest sample and (measured, predicted) ms."""
    policies = list(rows)
    totals = pass_totals(order, times, policies, first)
    ref = policies[0]
    out = {"policies": [], "iterations": []}
    for p, r in rows.items():
        out["policies"].append({
            "policy": p, "median_iteration_ms": 1e3 * r["seconds"],
            "total_s": sum(r["per_iter"].values()),
            "total_ratio": sum(r["per_iter"].values()) / sum(rows[ref]["per_iter"].values()),
            "pass_ratios": [a / b for a, b in zip(totals[p], totals[ref])],
            "local_share": r["local"], "micro_batches": r["mbs"],
            "predicted_ms": 1e3 * r["predicted"], "split_s": r["split"]})
    for i in sorted(rows[ref]["per_iter"]):
        lengths = plans[ref][i].lengths
        row = {"iter": i, "tokens": int(lengths.sum()), "longest": int(lengths.max())}
        for p in policies:
            row[p] = [1e3 * rows[p]["per_iter"][i],
                      1e3 * plans[p][i].predicted["iteration_time"]]
        out["iterations"].append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="h256", choices=sorted(th.MODELS))
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=12288)
    ap.add_argument("--seed", type=int, default=1, help="sampler seed (same for all policies)")
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per policy")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every (iteration, policy); their median is the time")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured first iterations")
    ap.add_argument("--warmup-passes", type=int, default=1,
                    help="unmeasured passes over every (iteration, policy) before the "
                         "measured repeats (default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES),
                    choices=["skrull", "all-cp", "per-seq-cp", "sorted", "hybrid-cp", "kk"],
                    help="schedulers to compare (the first one is the reference; default: "
                         "%(default)s)")
    ap.add_argument("--cost-model-config",
                    help="--skrull-cost-model-config for every policy's planning (a file "
                         "fitted to this machine by calibrate_training_cpu.py "
                         "--cost-model-config; default: the built-in cpu preset)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the time split timers")
    ap.add_argument("--data-dir", help="where the corpus goes (default: a temporary dir)")
    ap.add_argument("--json", help="also write every run's times and split here")
    args = ap.parse_args(argv)
    run = results_io.start()
    t0 = time.time()
    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        prefix = th.make_corpus(args.data_dir or tmp, seq_length=SEQ_LENGTH)
        run_argv, batches, plans = build(args, prefix)
        order, res = run_passes(run_argv, batches, tuple(args.policies), args)
    times = [th.median(t) for t in res["times"]]
    parts = [{k: th.median([r[k] for r in reps]) for k in th.PARTS} for reps in res["parts"]] \
        if res["parts"] and res["parts"][0] else []
    spec = th.MODELS[args.model]
    print(f"model {spec}, seq {SEQ_LENGTH}, global batch {args.global_batch_size}, bucket "
          f"{args.bucket}, CP 2 x DP 1 (2 processes, 1 thread each), sampler seed {args.seed}; "
          f"{args.iters} measured iterations after {args.warmup} warm-up, "
          f"{args.warmup_passes} unmeasured pass(es) over every case, then each run "
          f"{args.repeats}x (median); {time.time() - t0:.0f} s; cost model "
          f"{args.cost_model_config or 'cpu preset'}; load average (1/5/15 min) at start "
          f"{load0}, at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    rows = summarize(order, times, parts, plans, args.warmup)
    print_tables(rows, plans, args.warmup)
    print_passes(order, res["times"], args.policies, args.warmup)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"order": order, "runs": res, "summary": rows}, f)
    results_io.record("bench_e2e_cpu", result_rows(order, res["times"], rows, plans,
                                                   args.warmup), run, argv)


if __name__ == "__main__":
    main()
