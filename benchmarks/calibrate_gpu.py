"""Measures the cost model's terms on the GPU at hand, fits them, and checks the fit on a
held-out training run of the launcher.

1. **Kernels** (:mod:`gpu_micro`): dense seconds per token (a layer without its core
   attention, and the LM head), attention against length for whole documents and for the
   zigzag shards of CP 2/4/8, with the run's attention kernel (SDPA per document if it has
   none on this device): ``c_attention``, ``attention_half_tokens``, the per-document call.
2. **Training iterations**: the launcher's ``Trainer.run_plan`` (gradients, clipping, AdamW)
   in this process on composed batches (a few tiny documents, the shortest and the median
   documents filling one bucket, the longest document, median documents filling three
   buckets) and sampler batches, median of interleaved repeats.  Regressors: each plan's
   prediction under unit cost models (:func:`skrull_ext.scheduler.predict`; DP = CP = 1, so
   they add up exactly); fitted by non-negative least squares on relative errors:
   ``c_linear``, ``c_attention`` (at the kernels' ``S_half``), the per-document and
   per-micro-batch overheads and the per-iteration overhead (optimizer step).
3. Writes the ``--skrull-cost-model-config`` file (``--cost-model-config``; ``calibration``
   holds date, GPU, torch version and the fit), loads it back as the launcher does, and runs
   the launcher's loop (``train()`` with plan-ahead and the iteration log line) on batches of
   a held-out sampler seed: predicted (logged by the scheduler) against measured.
4. Optionally the online refit (``--skrull-online-cost-model``) on the same loop, seeded with
   the ``h100`` preset and/or the calibrated file (``--online-seeds``).

Every stage ends by its share of ``--time-budget-s`` (kernels 25%, fit 60%, held-out 80%,
online 100%); what did not fit is listed under ``budget.skipped``.  Usage (launcher flags
after the script's own; ``--shape`` adds a model's flags)::

    python benchmarks/calibrate_gpu.py --shape qwen2.5-0.5b --json cal.json \\
        --cost-model-config h200_qwen0.5b.json --time-budget-s 150 \\
        --device cuda --bf16 --recompute-granularity selective \\
        --seq-length 32768 --skrull-bucket-size 32768 --global-batch-size 16
    python benchmarks/calibrate_gpu.py --shape tiny --device cpu --json cal.json  # CPU check
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common as gc_  # noqa: E402
import gpu_micro  # noqa: E402
import results_io  # noqa: E402
from calibrate_cpu import nonneg_lstsq  # noqa: E402

from skrull_ext.costmodel.model import CostModel, TimeModel  # noqa: E402

FIT_SEEDS = (101, 102)
HELD_OUT_SEED = 4321
SIZES = {  # kernel runs: dense token counts, attention lengths, CP sizes, tokens per pack
    "cuda": dict(dense=(2048, 8192, 16384), lengths=(128, 512, 2048, 8192, 32768),
                 cp=(2, 4, 8), pack=32768),
    "cpu": dict(dense=(64, 128, 256), lengths=(16, 64, 256), cp=(2, 4), pack=256),
}
TERMS = ("c_linear", "c_attention", "attention_call_overhead", "micro_batch_overhead")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(gc_.SHAPES), help="add this model's flags")
    ap.add_argument("--json", help="write everything measured and fitted here")
    ap.add_argument("--cost-model-config", help="write the --skrull-cost-model-config file here "
                    "(default: next to --json, else calibrated_cost_model.json)")
    ap.add_argument("--time-budget-s", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case (after a warm-up)")
    ap.add_argument("--validate-iters", type=int, default=10)
    ap.add_argument("--online-iters", type=int, default=16)
    ap.add_argument("--online-seeds", default="h100",
                    help="comma-separated seeds of the online refit check: h100, calibrated "
                         "(empty: skip the check)")
    ap.add_argument("--micro-kernel", help="attention kernel of the kernel runs (default: the "
                    "run's --skrull-attention-kernel; sdpa: SDPA per document)")
    ap.add_argument("--skip-iters", type=int, default=2,
                    help="first iterations of a loop left out of its summary (warm-up)")
    args, launcher = ap.parse_known_args(argv)
    return args, launcher


def micro_stage(cfg, spec, device, dtype, budget, kernel_name=None) -> dict:
    """Stage 1: dense and attention kernel runs and their fits (``kernel_name``: the
    attention kernel, default the run's; ``sdpa`` forces the fallback)."""
    sizes = SIZES["cuda" if device.type == "cuda" else "cpu"]
    lengths = [s for s in sizes["lengths"] if s <= cfg.seq_length] or [cfg.seq_length]
    kernel, label = gpu_micro.resolve_kernel(kernel_name or cfg.skrull.attention_kernel,
                                             device, dtype)
    print(f"kernels: dense {sizes['dense']} tokens, attention {lengths} ({label}), CP "
          f"{sizes['cp']}", flush=True)
    layer_fns, head_fns = gpu_micro.dense_runs(spec, sizes["dense"], device, dtype)
    cases = gpu_micro.attention_cases(lengths, sizes["cp"], sizes["pack"])
    att_fns = gpu_micro.attention_runs(kernel, spec, cases, device, dtype)
    times = gc_.time_runs(layer_fns + head_fns + att_fns, device, 3, budget.until(0.25))
    n = len(layer_fns)
    dense = gpu_micro.fit_dense(spec, sizes["dense"], times[:n], times[n:2 * n])
    attention = gpu_micro.fit_attention(spec, cases, times[2 * n:])
    del layer_fns, head_fns, att_fns
    gc_.free_memory()
    rate = 1e-12 / attention["c_attention"] if attention["c_attention"] > 0 else float("inf")
    print(f"  dense: {dense['tflops']:.1f} TFLOP/s ({1e6 * dense['model_seconds_per_token']:.2f}"
          f" us per token, all layers and the head); attention: c_attention "
          f"{attention['c_attention']:.3e} s/FLOP ({rate:.1f} TFLOP/s on long blocks), "
          f"S_half {attention['attention_half_tokens']:.0f}, "
          f"{1e6 * attention['attention_call_overhead']:.1f} us per call; fit max "
          f"{attention['max_abs_pct']:.1f}%", flush=True)
    for row in attention["rows"]:
        print(f"    CP {row['cp']} S {row['length']:6d}: {1e3 * row['seconds_per_document']:8.3f}"
              f" ms/doc ({row['tflops']:.1f} TFLOP/s), fit {1e3 * row['predicted']:8.3f} ms")
    return {"kernel": label, "dense": dense, "attention": attention,
            "dense_tokens": list(sizes["dense"]), "cases": cases, "seconds": times[2 * n:]}


def kernel_time_model(micro: dict) -> TimeModel:
    """The seed of the training fit: the kernels' terms, no overheads."""
    a = micro["attention"]
    return TimeModel(c_linear=micro["dense"]["c_linear"], c_attention=a["c_attention"],
                     attention_half_tokens=a["attention_half_tokens"],
                     attention_call_overhead=a["attention_call_overhead"])


def fit_cases(source, cfg) -> list[tuple[str, np.ndarray]]:
    """``(label, dataset ids)``: composed batches that separate the terms, and sampler ones."""
    import train_harness as th

    lengths, bucket = source.lengths, cfg.skrull.bucket_size
    asc = np.argsort(lengths, kind="stable")
    near = np.argsort(np.abs(lengths - np.median(lengths)), kind="stable")
    cases = [("4 shortest", asc[:4]),
             ("shortest x 1 bucket", gc_.fill(lengths, asc, bucket, bucket)),
             ("median x 1 bucket", gc_.fill(lengths, near, bucket, bucket)),
             ("longest", asc[-1:]),
             ("median x 3 buckets", gc_.fill(lengths, near, 3 * bucket, bucket))]
    cases += [(f"sampler seed {s}", th.global_batches(source, cfg.global_batch_size, s, 1)[0])
              for s in FIT_SEEDS]
    return cases


def regressors(plan, spec, half: float) -> np.ndarray:
    """``[len(TERMS) + 1]``: the plan's predicted seconds with one unit coefficient each
    (``c_attention`` at ``S_half`` = ``half``), then 1 (the iteration overhead)."""
    from skrull_ext.scheduler import predict

    out = []
    for term in TERMS:
        kw = dict(c_linear=0.0, c_attention=0.0, attention_half_tokens=half)
        kw[term] = 1.0
        out.append(predict(plan, CostModel(model=spec, time=TimeModel(**kw)))["iteration_time"])
    return np.array(out + [1.0])


def fit_terms(x: np.ndarray, y: np.ndarray, prior, pull: float = 0.01) -> np.ndarray:
    """Non-negative least squares of ``y ~ x w`` on relative errors, each ``w_j`` with a
    kernel-level ``prior_j > 0`` pulled towards it by a pseudo-row of weight ``pull``
    (relative to one measured iteration): terms the cases do not separate -- per-document
    against per-micro-batch costs, say -- stay near what the kernels measured instead of
    trading off freely; terms the cases do determine move as far as they demand."""
    rows, target = [x / y[:, None]], [np.ones(len(y))]
    for j, p in enumerate(prior):
        if p > 0:
            e = np.zeros((1, x.shape[1]))
            e[0, j] = pull / p
            rows.append(e)
            target.append(np.array([pull]))
    return nonneg_lstsq(np.concatenate(rows), np.concatenate(target), relative=False)


def fit_stage(trainer, cfg, spec, micro, device, budget, repeats) -> dict:
    """Stage 2: the launcher's iterations on :func:`fit_cases`, and the fitted time model."""
    seed = CostModel(model=spec, time=kernel_time_model(micro))
    half = seed.time.attention_half_tokens
    cases, labels = [], []
    for label, ids in fit_cases(trainer.source, cfg):
        cases.append((ids, gc_.plan_for(trainer.source.lengths[ids], seed,
                                         cfg.skrull.bucket_size)))
        labels.append(label)
    times = gc_.run_plans(trainer, cases, device, repeats, budget.until(0.6))
    keep = [i for i, t in enumerate(times) if t is not None]
    x = np.stack([regressors(cases[i][1], spec, half) for i in keep])
    y = np.array([times[i] for i in keep])
    coef = fit_terms(x, y, [getattr(seed.time, t) for t in TERMS] + [0.0])
    tm = TimeModel(c_linear=coef[0], c_attention=coef[1], attention_half_tokens=half,
                   attention_call_overhead=coef[2], micro_batch_overhead=coef[3],
                   iteration_overhead=coef[4])
    pred = x @ coef
    rows = [{"case": labels[i], "tokens": int(trainer.source.lengths[cases[i][0]].sum()),
             "documents": len(cases[i][0]), "micro_batches": cases[i][1].num_micro_batches,
             "measured": float(m), "predicted": float(p)} for i, m, p in zip(keep, y, pred)]
    for r in rows:
        err = 100 * (r["predicted"] / r["measured"] - 1)
        print(f"  {r['case']:22s} {r['documents']:4d} docs {r['tokens']:7d} tokens "
              f"{r['micro_batches']:2d} mbs: {1e3 * r['measured']:8.1f} ms, fit "
              f"{1e3 * r['predicted']:8.1f} ms ({err:+.1f}%)")
    return {"time_model": dataclasses.asdict(tm), "cases": rows,
            "error": gc_.summarize_errors(y, pred)}


def write_config(path: str, tm: dict, meta: dict, dtype) -> dict:
    """The ``--skrull-cost-model-config`` file (no ring terms: one GPU has no ring)."""
    config = {k: float(tm[k]) for k in ("c_linear", "c_attention", "micro_batch_overhead",
                                        "attention_half_tokens", "attention_call_overhead",
                                        "iteration_overhead")}
    config["bytes_per_element"] = torch.tensor([], dtype=dtype).element_size()
    config["calibration"] = meta
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return config


def run_loop(trainer, cfg, vocab, cost, *, online: bool, iters: int, deadline: float):
    """The launcher's loop (``train()``: plan ahead, plan check, online refit, log line) for
    ``iters`` iterations on the held-out sampler seed, planned with ``cost``."""
    from megatron.skrull.batch_schedule import make_batch_scheduler
    from megatron.skrull.data import GlobalBatchSampler
    from megatron.skrull.plan_ahead import PlannedBatches
    from megatron.skrull.training import MetricsLogger, train

    run = dataclasses.replace(cfg, skrull=dataclasses.replace(cfg.skrull,
                                                              online_cost_model=online))
    scheduler = make_batch_scheduler(run, vocab, cost_model=cost)
    sampler = GlobalBatchSampler(len(trainer.source), cfg.global_batch_size, HELD_OUT_SEED)
    trainer.batch_scheduler = scheduler
    trainer.sampler = PlannedBatches(sampler, trainer.source.lengths, scheduler,
                                     ahead=cfg.skrull.plan_ahead)
    last = trainer.iteration + iters
    metrics = MetricsLogger(log_interval=1, train_iters=last, enabled=True,
                            printer=lambda s: print(s, flush=True), log_throughput=True)
    return train(trainer, train_iters=last, metrics=metrics,
                 exit_fn=lambda t: time.monotonic() > deadline)


def loop_report(history, skip: int) -> dict:
    rows = [{"iteration": s.iteration, "measured": s.seconds, "predicted": s.predicted_seconds,
             "tokens": s.tokens, "micro_batches": s.micro_batches} for s in history]
    kept = [r for r in rows[skip:] if r["predicted"] is not None]
    summary = gc_.summarize_errors([r["measured"] for r in kept], [r["predicted"] for r in kept])
    return {"iterations": rows, "summary": summary, "skipped_first": skip}


def seed_cost(name: str, cfg, vocab, config_path: str):
    """An online refit's seed: the ``h100`` preset, or the calibrated file, as the launcher
    builds them from flags."""
    from megatron.skrull.batch_schedule import build_cost_model

    if name == "h100":
        sk = dataclasses.replace(cfg.skrull, hardware="h100", cost_model_config=None)
    elif name == "calibrated":
        sk = dataclasses.replace(cfg.skrull, cost_model_config=config_path)
    else:
        raise ValueError(f"--online-seeds: unknown seed {name!r}; use h100 or calibrated")
    return build_cost_model(dataclasses.replace(cfg, skrull=sk), vocab)


def describe(argv_run):
    """``(cfg, spec, device, meta)`` of the launcher flags, before anything is built."""
    from megatron.skrull.batch_schedule import model_spec
    from megatron.skrull.cpu_compat import resolve_device
    from train_harness import load_run

    cfg, _, vocab = load_run(argv_run, 1)
    device, spec = resolve_device(cfg.device), model_spec(cfg, vocab)
    meta = {**gc_.environment(device), "method": "benchmarks/calibrate_gpu.py",
            "launcher_flags": list(argv_run), "model": dataclasses.asdict(spec)}
    print(f"calibrate_gpu: {meta['device']}, torch {meta['torch']}, {spec.num_layers} layers, "
          f"hidden {spec.hidden_size}, {spec.param_count() / 1e6:.0f} M parameters, "
          f"{cfg.params_dtype}", flush=True)
    return cfg, spec, device, meta


def calibrate(out: dict, argv_run, spec, device, config_path: str, args, budget) -> None:
    """Stages 2-4 on the launcher built in this process (results into ``out``)."""
    cfg, trainer, vocab = gc_.start_run(argv_run)
    print("training iterations (launcher's Trainer.run_plan):", flush=True)
    fit = out["fit"] = fit_stage(trainer, cfg, spec, out["kernels"], device, budget,
                                 args.repeats)
    meta = dict(out["calibration"], fit_error=fit["error"])
    out["cost_model"] = write_config(config_path, fit["time_model"], meta, cfg.params_dtype)
    print(f"wrote {config_path}: " + ", ".join(
        f"{k} {v:.4g}" for k, v in out["cost_model"].items() if isinstance(v, float)))
    out["validation"] = validate(trainer, cfg, vocab, config_path, args, budget)
    out["online"] = online_check(trainer, cfg, vocab, config_path, args, budget)


def main(argv=None) -> int:
    from megatron.skrull.arguments import ConfigError
    from megatron.skrull.pretrain_gpt import SetupError

    args, launcher = parse(argv)
    run = results_io.start()
    budget = gc_.Budget(args.time_budget_s)
    argv_run = gc_.launcher_argv(args.shape, launcher, seq_length=32768, bucket=32768)
    config_path = args.cost_model_config or (
        os.path.splitext(args.json)[0] + "_cost_model.json" if args.json
        else "calibrated_cost_model.json")
    status, out = 0, {}
    try:
        cfg, spec, device, meta = describe(argv_run)
        out["calibration"] = meta
        out["kernels"] = micro_stage(cfg, spec, device, cfg.params_dtype, budget,
                                     args.micro_kernel)
        meta["kernel"] = out["kernels"]["kernel"]
        calibrate(out, argv_run, spec, device, config_path, args, budget)
    except (ConfigError, SetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 2
    finally:
        gc_.stop_run()
    out["budget"] = budget.report()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, default=str)
    results_io.record("calibrate_gpu", out, run, argv)
    if not status:
        print_summary(out)
    return status


def validate(trainer, cfg, vocab, config_path, args, budget) -> dict:
    """Stage 3: the held-out run with the calibrated file, fixed."""
    if time.monotonic() > budget.until(0.8) or args.validate_iters < 1:
        budget.skip("held-out run")
        return {}
    cost = seed_cost("calibrated", cfg, vocab, config_path)
    print(f"held-out run: {args.validate_iters} iterations of the launcher's loop, sampler seed "
          f"{HELD_OUT_SEED}, predicted by {config_path}", flush=True)
    history = run_loop(trainer, cfg, vocab, cost, online=False, iters=args.validate_iters,
                       deadline=budget.until(0.8))
    return loop_report(history, args.skip_iters)


def online_check(trainer, cfg, vocab, config_path, args, budget) -> dict:
    """Stage 4: the same loop with ``--skrull-online-cost-model`` from each seed."""
    seeds = [s for s in args.online_seeds.split(",") if s]
    out = {}
    for i, name in enumerate(seeds):
        end = budget.until(0.8 + 0.2 * (i + 1) / len(seeds))
        if time.monotonic() >= end or args.online_iters < 1:
            budget.skip(f"online refit from {name}")
            continue
        print(f"online refit seeded with {name}: {args.online_iters} iterations", flush=True)
        history = run_loop(trainer, cfg, vocab, seed_cost(name, cfg, vocab, config_path),
                           online=True, iters=args.online_iters, deadline=end)
        out[name] = loop_report(history, max(args.skip_iters, 5))
    return out


def print_summary(out: dict) -> None:
    v = out.get("validation", {}).get("summary", {})
    if v.get("n"):
        print(f"held-out: predicted / measured - 1 over {v['n']} iterations: median "
              f"{v['median_abs_pct']:.1f}%, max {v['max_abs_pct']:.1f}%, totals "
              f"{v['total_pct']:+.1f}% (goal: within 15%)")
    for name, rep in out.get("online", {}).items():
        s = rep["summary"]
        if s.get("n"):
            print(f"online refit from {name}: median {s['median_abs_pct']:.1f}%, max "
                  f"{s['max_abs_pct']:.1f}% over the last {s['n']} iterations (goal: within "
                  "10%)")
    print(f"time: {out['budget']['used']:.0f} s of {out['budget']['seconds']:.0f} s"
          + (f"; skipped: {', '.join(out['budget']['skipped'])}" if out['budget']['skipped']
             else ""))


if __name__ == "__main__":
    sys.exit(main())
