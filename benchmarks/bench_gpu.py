"""Tokens/s and MFU on one GPU: our stack against Hugging Face transformers, same batches.

For each model shape (``--models``: Qwen2.5-0.5B and -1.5B by default) the same global
batches of the mock data (``--global-batch-size`` documents of up to ``--seq-length``
tokens, long-tailed, sampler seed ``--seed``) are trained, ``--iters`` timed iterations after
one warm-up, by:

* **ours**: the launcher's trainer built in this process (mcore GPT, DACP attention, mcore
  DDP + AdamW with fp32 main parameters, bf16), each global batch planned by the launcher's
  batch scheduler into micro-batches of ``--skrull-bucket-size`` tokens; once per attention
  kernel of ``--kernels`` that is available (``torch``, ``flash``, ``te``);
* **transformers**: ``Qwen2ForCausalLM`` built from the same shape (fp32 weights under
  ``torch.autocast`` bf16, as the HF Trainer's ``bf16=True``; ``torch.optim.AdamW``,
  fused on CUDA; gradient clipping 1.0 as ours), per ``--hf-attn`` implementation (``sdpa``,
  and ``flash_attention_2`` when flash-attn is installed), in two modes: ``packed`` -- our
  plan's micro-batches, each one sequence with ``position_ids`` restarting at every
  document (transformers then masks attention per document) -- and ``per-doc`` -- every
  document its own forward/backward.  Gradients accumulate over the global batch.  A mode
  that runs out of memory is retried once with gradient checkpointing.

Per row: tokens/s (real tokens of the batches over the timed seconds), model TFLOP/s per GPU
(:func:`skrull_ext.costmodel.flops.model_flops` of the documents, Megatron's
``--log-throughput`` count, the same FLOPs for every row of a model) and MFU against the
peak (``--peak-tflops``, else :data:`skrull_ext.costmodel.flops.PEAK_BF16_TFLOPS` by GPU
name).  Usage::

    python benchmarks/bench_gpu.py --json gpu.json --time-budget-s 150 [launcher flags]
    python benchmarks/bench_gpu.py --models tiny --device cpu --seq-length 128 \\
        --skrull-bucket-size 128 --global-batch-size 4 --iters 2 --json gpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_common as gc_  # noqa: E402
import results_io  # noqa: E402
import hf_baseline  # noqa: E402

from skrull_ext.costmodel.flops import model_flops, peak_tflops  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--kernels", default="torch,flash,te", help="our attention kernels to run")
    ap.add_argument("--hf-attn", default="sdpa,flash_attention_2",
                    help="transformers attn_implementation values (unavailable ones skipped)")
    ap.add_argument("--hf-modes", default="packed,per-doc")
    ap.add_argument("--iters", type=int, default=4, help="timed iterations (after a warm-up)")
    ap.add_argument("--seed", type=int, default=11, help="sampler seed of the batches")
    ap.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s per GPU for MFU")
    ap.add_argument("--time-budget-s", type=float, default=150.0)
    ap.add_argument("--json")
    return ap.parse_known_args(argv)


def row(system: str, variant: str, tokens: int, flops: float, seconds: float, iters: int,
        peak) -> dict:
    tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
    return {"system": system, "variant": variant, "iterations": iters, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "tflops_per_gpu": tflops,
            "mfu": tflops / peak if peak else None}


def run_ours(argv, args, peak, deadline) -> tuple[list, list, object]:
    """Our rows (one per available kernel), the batches as HF inputs, and the model spec."""
    from megatron.skrull.batch_schedule import model_spec
    from skrull_ext.attention import get_kernel
    import train_harness as th

    cfg, trainer, vocab = gc_.start_run(argv)
    try:
        spec = model_spec(cfg, vocab)
        src = trainer.source
        batches = th.global_batches(src, cfg.global_batch_size, args.seed, args.iters + 1)
        plans = [trainer.batch_scheduler(src.lengths[ids]) for ids in batches]
        work = list(zip(batches, plans))
        tokens = sum(int(src.lengths[ids].sum()) for ids in batches[1:])
        flops = sum(model_flops(spec, src.lengths[ids]) for ids in batches[1:])
        rows = []
        for name in [k for k in args.kernels.split(",") if k]:
            try:
                kernel = get_kernel(name, trainer.device, cfg.params_dtype)
            except (RuntimeError, ValueError) as exc:
                rows.append({"system": "ours", "variant": name, "skipped": str(exc)})
                continue
            trainer.attention_backend = kernel.name
            seconds, n = _guarded(lambda: gc_.timed(lambda w: trainer.run_plan(*w), work,
                                                trainer.device, deadline))
            share = _share(n, len(work) - 1)
            rows.append(row("ours", name, tokens * share, flops * share, seconds, n, peak)
                        if n else {"system": "ours", "variant": name, "skipped": seconds})
        packs = hf_baseline.packed_inputs(src, batches, plans, trainer.device)
        return rows, packs, (spec, cfg, vocab, tokens, flops)
    finally:
        trainer = None
        gc_.stop_run()


def _share(done: int, total: int) -> float:
    return done / total if total else 0.0


def _guarded(fn):
    """``fn()``, or ``(reason, 0)`` when the device runs out of memory (the memory is
    returned once the exception and its frames are gone)."""
    try:
        return fn()
    except torch.OutOfMemoryError as exc:
        reason = f"out of memory ({str(exc).splitlines()[0][:120]})"
    gc_.free_memory()
    return reason, 0


def run_hf(args, packs, shape, device, peak, deadline) -> list:
    """transformers' rows: each attention implementation and mode on the same batches."""
    spec, cfg, vocab, tokens, flops = shape
    rows = []
    for attn in [a for a in args.hf_attn.split(",") if a]:
        reason = hf_baseline.unavailable(attn, device)
        if reason:
            rows.append({"system": "transformers", "variant": attn, "skipped": reason})
            continue
        for mode in [m for m in args.hf_modes.split(",") if m]:
            if time.monotonic() > deadline:
                rows.append({"system": "transformers", "variant": f"{attn} {mode}",
                             "skipped": "time budget"})
                continue
            for ckpt in (False, True):
                seconds, n = _guarded(lambda: hf_baseline.run(
                    cfg, vocab, attn, mode, packs, device, ckpt, deadline))
                if n or ckpt:
                    break
            variant = f"{attn} {mode}" + (" + checkpointing" if ckpt else "")
            share = _share(n, len(packs) - 1)
            rows.append(row("transformers", variant, tokens * share, flops * share, seconds, n,
                            peak) if n else {"system": "transformers", "variant": variant,
                                             "skipped": seconds})
    return rows


def print_table(model: str, rows: list) -> None:
    hf = [r["tokens_per_s"] for r in rows if r["system"] == "transformers" and "skipped" not in r]
    best = max(hf, default=0.0)
    print(f"\n{model}: system / variant / tokens/s / TFLOP/s per GPU / MFU / vs best transformers")
    for r in rows:
        if "skipped" in r:
            print(f"  {r['system']:12s} {r['variant']:34s} skipped: {r['skipped']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        vs = f"{r['tokens_per_s'] / best:.2f}x" if best else "n/a"
        print(f"  {r['system']:12s} {r['variant']:34s} {r['tokens_per_s']:10.0f} "
              f"{r['tflops_per_gpu']:8.1f} {mfu:>7s} {vs:>7s}")


def bench_model(model: str, i: int, n: int, args, launcher, budget) -> dict:
    """Ours, then transformers, on one model shape within its share of the budget."""
    from megatron.skrull.cpu_compat import resolve_device

    deadline = budget.until((i + 1) / n)
    argv_run = gc_.launcher_argv(model, launcher, seq_length=8192, bucket=8192)
    device = resolve_device(gc_.flag_value(argv_run, "--device", "auto"))
    env = gc_.environment(device)
    peak = args.peak_tflops or (peak_tflops(env["device"]) if device.type == "cuda" else None)
    ours, packs, shape = run_ours(argv_run, args, peak, budget.until((i + 0.45) / n))
    hf = run_hf(args, packs, shape, device, peak, deadline)
    print_table(model, ours + hf)
    return {"environment": env, "peak_tflops": peak, "launcher_flags": argv_run,
            "rows": ours + hf, "tokens": shape[3], "flops": shape[4]}


def main(argv=None) -> int:
    from megatron.skrull.arguments import ConfigError
    from megatron.skrull.pretrain_gpt import SetupError

    args, launcher = parse(argv)
    run = results_io.start()
    budget = gc_.Budget(args.time_budget_s)
    models = [m for m in args.models.split(",") if m]
    out, status = {"models": {}}, 0
    for i, model in enumerate(models):
        if time.monotonic() > budget.until((i + 1) / len(models)):
            budget.skip(model)
            continue
        try:
            out["models"][model] = bench_model(model, i, len(models), args, launcher, budget)
        except (ConfigError, SetupError, ValueError) as exc:  # e.g. no attention kernel
            print(f"error: {model}: {exc}", file=sys.stderr)
            out["models"][model], status = {"error": str(exc)}, 2
            gc_.stop_run()
    out["budget"] = budget.report()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    results_io.record("bench_gpu", out, run, argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
