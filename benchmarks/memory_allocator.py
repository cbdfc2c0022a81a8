"""Peak memory of the launcher's training iterations against the memory model
(``bench_memory.py --device cuda``, or ``--device cpu`` on the tiny shape).

For each recompute setting the launcher accepts (none, ``selective``, ``full`` uniform 1),
the trainer is built in this process (``gpu_common.start_run``), one warm-up iteration
allocates the optimizer state, then for every bucket one iteration runs a micro-batch
filled to the bucket (documents of the mock data, longest first, while they fit), and:

* **measured**: on CUDA ``torch.cuda.max_memory_allocated`` over the iteration (after
  ``reset_peak_memory_stats``), and ``memory_allocated`` before it (the static part); on
  CPU (no allocator statistics) the parameters', gradients' and optimizer's storages plus
  the peak of live saved-for-backward tensors (``bench_memory.SavedTensorPeak``);
* **predicted**: :class:`skrull_ext.costmodel.memory.TrainingMemory`'s static bytes plus
  ``alpha x tokens`` (what the planner sizes the bucket with; on CPU ``alpha`` of the
  saved tensors only, what the CPU measures, and torch's composite RMSNorm:
  :func:`~skrull_ext.costmodel.memory.norm_for`);
* a line ``bytes = alpha x tokens + beta`` fitted through the buckets
  (:meth:`MemoryModel.fit`): the measured ``alpha`` to pass the planner as
  ``--activation-bytes-per-token`` if the model's is off.

Then the planner's recommended bucket for this device's memory
(:func:`skrull_ext.planner.cli.memory_bucket`, default 10% margin) is trained once with a
micro-batch filled to it: it must not run out of memory.
"""
from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch

import gpu_common as gc_

SETTINGS = {"selective": ("selective recompute", ["--recompute-granularity", "selective"]),
            "none": ("no recompute", []),
            "full": ("full recompute", ["--recompute-granularity", "full", "--recompute-method",
                                        "uniform", "--recompute-num-layers", "1"])}
BUCKETS = {"cuda": (8192, 16384, 32768), "cpu": (64, 128, 256)}
GIB = float(1 << 30)


@contextlib.contextmanager
def peak_meter(trainer, device):
    """Yields a dict that holds ``static`` and ``peak`` bytes of the enclosed iteration."""
    out = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out["static"] = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak"] = torch.cuda.max_memory_allocated(device)
        return
    from bench_memory import SavedTensorPeak, _storages, measure_static

    out["static"] = sum(measure_static(trainer).values())
    tracker = SavedTensorPeak(_storages(trainer.model.parameters()))
    with tracker.hooks():
        yield out
    out["peak"] = out["static"] + tracker.peak


def filled_batch(source, bucket: int) -> np.ndarray:
    """Dataset ids of documents that fill one ``bucket``-token micro-batch, longest first."""
    order = np.argsort(-source.lengths, kind="stable")
    return gc_.fill(source.lengths, order, bucket, bucket)


def predicted_alpha(training, spec, device) -> float:
    """The model's bytes per token of what ``device``'s meter sees (CPU: saved tensors)."""
    from skrull_ext.costmodel.activations import SAVED

    kinds = {"kinds": (SAVED,)} if device.type == "cpu" else {}
    return training.activation_bytes_per_token(spec, **kinds)


def one_iteration(trainer, spec, training, bucket: int, device) -> dict:
    """Runs a micro-batch filled to ``bucket``; measured and predicted bytes (or ``oom``)."""
    from skrull_ext.costmodel.model import default_cost_model

    ids = filled_batch(trainer.source, bucket)
    plan = gc_.plan_for(trainer.source.lengths[ids], default_cost_model(spec), bucket)
    tokens = max(sum(int(plan.lengths[s]) for s in mb.samples()) for mb in plan.dp_ranks[0])
    row = {"bucket": bucket, "tokens": tokens,
           "predicted_static": training.static_bytes(spec),
           "predicted_peak": training.static_bytes(spec)
           + predicted_alpha(training, spec, device) * tokens}
    try:
        with peak_meter(trainer, device) as m:
            trainer.run_plan(ids, plan)
        row.update(measured_static=m["static"], measured_peak=m["peak"], oom=False)
        row["error_pct"] = 100 * (row["predicted_peak"] / row["measured_peak"] - 1)
    except torch.OutOfMemoryError:
        row["oom"] = True
    if row["oom"]:  # outside the handler: its frames no longer hold the tensors
        trainer.model.zero_grad_buffer()
        gc_.free_memory()
    return row


def recommended_bucket(spec, training, device, device_gb) -> int:
    """The planner's bucket for this device's memory (10% margin; CPU: 16 GiB unless
    ``device_gb`` says otherwise)."""
    from skrull_ext.costmodel.hardware import get_hardware
    from skrull_ext.planner.cli import DEFAULT_DEVICE_GB, memory_bucket

    if device_gb is None:
        device_gb = (torch.cuda.get_device_properties(device).total_memory / GIB
                     if device.type == "cuda" else DEFAULT_DEVICE_GB["cpu"])
    hw = get_hardware("h100" if device.type == "cuda" else "cpu")
    return memory_bucket(spec, hw, 1, 1, device_gb=device_gb, training=training)


def fitted_line(rows) -> dict:
    from skrull_ext.costmodel.model import MemoryModel

    ok = [r for r in rows if not r.get("oom")]
    if len({r["tokens"] for r in ok}) < 2:
        return {}
    line = MemoryModel.fit([r["tokens"] for r in ok], [r["measured_peak"] for r in ok])
    return {"alpha_bytes_per_token": line.alpha, "beta_bytes": line.beta}


def run_setting(name, flags, recompute, base_argv, buckets, device_gb, deadline) -> dict:
    """One recompute setting: the buckets, the fitted line, the recommended bucket's run."""
    from megatron.skrull.batch_schedule import model_spec

    cfg, trainer, vocab = gc_.start_run([*base_argv, *flags])
    try:
        device = trainer.device
        spec = model_spec(cfg, vocab)
        training = gc_.training_memory(cfg, device, recompute)
        one_iteration(trainer, spec, training, min(buckets), device)  # optimizer state
        rows = []
        for bucket in buckets:
            if time.monotonic() > deadline:
                break
            rows.append(one_iteration(trainer, spec, training, bucket, device))
            print_row(name, rows[-1])
        out = {"setting": name, "alpha_model": predicted_alpha(training, spec, device),
               "rows": rows, "fit": fitted_line(rows)}
        if time.monotonic() < deadline:
            rec = recommended_bucket(spec, training, device, device_gb)
            out["recommended"] = one_iteration(trainer, spec, training, rec, device)
            print_row(name + ", planner's bucket", out["recommended"])
        return out
    finally:
        trainer = None
        gc_.stop_run()


def print_row(name: str, r: dict) -> None:
    if r.get("oom"):
        print(f"  {name:36s} bucket {r['bucket']:7d}: OUT OF MEMORY (predicted "
              f"{r['predicted_peak'] / GIB:.2f} GiB)", flush=True)
        return
    print(f"  {name:36s} bucket {r['bucket']:7d} ({r['tokens']:7d} tokens): static "
          f"{r['measured_static'] / GIB:7.3f} / {r['predicted_static'] / GIB:7.3f} GiB, peak "
          f"{r['measured_peak'] / GIB:7.3f} / {r['predicted_peak'] / GIB:7.3f} GiB "
          f"({r['error_pct']:+.1f}%)", flush=True)


def main(args, launcher) -> dict:
    """``bench_memory.py --device``: every setting within ``--time-budget-s``."""
    from megatron.skrull.arguments import ConfigError
    from megatron.skrull.cpu_compat import resolve_device
    from megatron.skrull.pretrain_gpt import SetupError

    budget = gc_.Budget(args.time_budget_s)
    device = resolve_device(args.device)
    buckets = tuple(args.buckets or BUCKETS[device.type])
    extra = ["--device", args.device]
    base = gc_.launcher_argv(args.shape or ("qwen2.5-0.5b" if device.type == "cuda" else "tiny"),
                             extra + list(launcher), seq_length=max(buckets),
                             bucket=max(buckets), global_batch=8)
    print(f"bench_memory: {gc_.environment(device)['device']}; measured / predicted "
          "(skrull_ext.costmodel.memory)", flush=True)
    results = []
    keys = [k for k in args.settings.split(",") if k]
    unknown = sorted(set(keys) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"error: --settings {','.join(unknown)}: use {','.join(SETTINGS)}")
    for i, key in enumerate(keys):
        name, flags = SETTINGS[key]
        deadline = budget.until((i + 1) / len(keys))
        if time.monotonic() > deadline:
            budget.skip(name)
            continue
        try:
            results.append(run_setting(name, flags, None if key == "none" else key, base,
                                       buckets, args.device_memory_gb, deadline))
        except (ConfigError, SetupError, ValueError) as exc:  # e.g. no attention kernel
            print(f"error: {name}: {exc}", file=sys.stderr)
            results.append({"setting": name, "error": str(exc)})
    return {"environment": gc_.environment(device), "launcher_flags": base,
            "settings": results, "budget": budget.report()}
