"""Measures this machine and fits the constants of the ``cpu`` hardware preset.

Micro-runs, single process unless noted, forward + backward, minimum over repeats:

1. attention: ``scaled_dot_product_attention(is_causal=True)`` (ATen's CPU flash kernel) on
   ``[1, heads, S, head_dim]`` for several ``S``; fit ``t = a2 S^2 + a1 S + a0`` (relative
   errors, coefficients >= 0).  With
   ``F = 7 h S^2`` training FLOPs per layer and ``eff(S) = S / (S + S_half)``:
   ``attention FLOP/s = 7 h / a2``, ``S_half = a1 / a2``, per-call overhead ``a0``.
2. linear: everything of one layer except attention (norms, QKV, output projection,
   SwiGLU MLP) on ``[T, h]``; fit ``t = l1 T + l0``: ``linear FLOP/s = 6 P / l1`` with ``P``
   the layer's matmul parameters, per-layer overhead ``l0``.
3. overheads: the whole tiny model (:mod:`cpu_block`) on micro-batches of ``k`` documents
   of 16 tokens; measured minus the simulator's prediction without overheads, regressed
   on ``k x layers`` (per-document attention overhead: slicing, GQA repeat, the kernel
   call) and a constant (per-micro-batch overhead).  A few larger micro-batches then
   check the fitted preset (printed, not fitted).
4. ring communication: gloo send/recv ping-pong between two processes (file store);
   one-way seconds per message size.

Also prints :meth:`skrull_ext.costmodel.model.TimeModel.calibrate` coefficients fitted to the
whole-model check runs (for the scheduler's simple cost model).  Repeats of all sizes
are interleaved (:func:`cpu_block.best_times`) and the minimum kept, as the machine is
shared.  Usage::

    PYTHONPATH=$PWD python benchmarks/calibrate_cpu.py [--json out.json] [--quick]
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
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402
from cpu_block import TINY_SPEC, Layer, TinyModel, best_times, micro_batch_step  # noqa: E402

from skrull_ext.costmodel.model import CommModel, TimeModel  # noqa: E402
from skrull_ext.costmodel.hardware import get_hardware  # noqa: E402
from skrull_ext.scheduler.plan import MicroBatch, Plan  # noqa: E402
from skrull_ext.planner.simulator import simulate  # noqa: E402


def nonneg_lstsq(a: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    """Least squares with coefficients clamped to >= 0 (drop the most negative, refit).

    ``relative``: minimise relative errors (rows scaled by ``1 / y``, so short and long runs
    count alike; needs ``y > 0``).
    """
    if relative:
        a, y = a / y[:, None], np.ones_like(y)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    scale = np.abs(a).max(axis=0)
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active] / scale[active], y, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def attention_runs(lengths):
    """Closures: causal SDPA forward + backward on ``[1, heads, S, head_dim]``."""
    spec = TINY_SPEC
    fns = []
    for s in lengths:
        q, k, v = (torch.randn(1, spec.num_attention_heads, s, spec.head_dim, requires_grad=True)
                   for _ in range(3))
        fns.append(lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True).sum().backward())
    return fns


def linear_runs(tokens):
    """Closures: one layer without its attention (norms, projections, MLP) on ``[T, h]``."""
    layer = Layer(TINY_SPEC)
    h = TINY_SPEC.hidden_size

    def run(x):
        y = x + layer.proj(layer.qkv(layer.norm1(x))[:, :h])
        gate, up = layer.fc1(layer.norm2(y)).chunk(2, dim=-1)
        (y + layer.fc2(torch.nn.functional.silu(gate) * up)).sum().backward()

    xs = [torch.randn(t, h, requires_grad=True) for t in tokens]
    return [lambda x=x: run(x) for x in xs]


def _pingpong(rank, store, sizes, repeats, result):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    times = []
    for n in sizes:
        buf = torch.zeros(n // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            best = min(best, (time.perf_counter() - start) / 2)
        times.append(best)
    if rank == 0:
        result.extend(times)
    dist.destroy_process_group()


def measure_comm(sizes, repeats):
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        result = manager.list()
        mp.spawn(_pingpong, args=(os.path.join(tmp, "store"), sizes, repeats, result), nprocs=2)
        return list(result)


# Whole-model micro-batches: tiny documents isolate the fixed costs; the others check the fit.
OVERHEAD_DOCS = (1, 4, 16, 32)
OVERHEAD_LEN = 16
CHECK_BATCHES = [[512], [64] * 8, [1024, 256, 128], [2048], [300, 700], [128] * 16]


def _predict_one(hardware, docs) -> float:
    lengths = np.asarray(docs, dtype=np.int64)
    mb = MicroBatch(distributed=(), local=(tuple(range(len(docs))),))
    plan = Plan(lengths=lengths, dp_size=1, cp_size=1, bucket_size=int(lengths.sum()),
                policy="calibration", dp_ranks=((mb,),))
    return simulate(plan, TINY_SPEC, hardware).iteration_time


def whole_model_runs(batches):
    """Closures: the tiny model forward + backward on each packed micro-batch."""
    torch.manual_seed(0)
    model = TinyModel(TINY_SPEC)
    gen = torch.Generator().manual_seed(0)
    return [micro_batch_step(model, d, gen) for d in batches]


def fit_compute(att_s, att_t, lin_tokens, lin_t):
    """Fits the compute constants of the preset from the attention and linear runs."""
    s = np.asarray(att_s, dtype=np.float64)
    a2, a1, a0 = nonneg_lstsq(np.stack([s * s, s, np.ones_like(s)], 1), np.asarray(att_t))
    t = np.asarray(lin_tokens, dtype=np.float64)
    l1, l0 = nonneg_lstsq(np.stack([t, np.ones_like(t)], 1), np.asarray(lin_t))
    lin_rate = 6.0 * TINY_SPEC.matmul_params_per_layer() / l1
    att_rate = 7.0 * TINY_SPEC.hidden_size / a2
    fitted = dataclasses.replace(
        get_hardware("cpu"), peak_flops=lin_rate, linear_efficiency=1.0, linear_half_tokens=0.0,
        attention_efficiency=att_rate / lin_rate, attention_half_tokens=a1 / a2,
        attention_call_overhead_s=0.0, layer_overhead_s=l0, micro_batch_overhead_s=0.0)
    return fitted, a0


def fit_overheads(hardware, batches, measured):
    """Per-document attention overhead and per-micro-batch overhead from tiny documents.

    Whole-model runs of ``k`` documents of 16 tokens, minus the simulator's prediction
    without those overheads, regressed on ``k x layers`` and a constant.
    """
    base = np.array([_predict_one(hardware, d) for d in batches])
    docs = np.array([len(d) * TINY_SPEC.num_layers for d in batches], dtype=np.float64)
    call, const = nonneg_lstsq(np.stack([docs, np.ones_like(docs)], 1),
                               np.asarray(measured) - base, relative=False)
    return dataclasses.replace(hardware, attention_call_overhead_s=float(call),
                               micro_batch_overhead_s=float(const))


def print_report(fitted, kernel_call, comm_sizes, comm_t, whole, predicted, tm):
    att_rate = fitted.peak_flops * fitted.attention_efficiency
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.ctime()}")
    print(f"attention: {att_rate / 1e9:.2f} GFLOP/s, S_half {fitted.attention_half_tokens:.0f} "
          f"tokens, bare kernel call {kernel_call * 1e6:.0f} us, whole-model per-document "
          f"overhead {fitted.attention_call_overhead_s * 1e6:.0f} us")
    print(f"linear:    {fitted.peak_flops / 1e9:.2f} GFLOP/s, per-layer overhead "
          f"{fitted.layer_overhead_s * 1e6:.0f} us")
    print(f"micro-batch overhead {fitted.micro_batch_overhead_s * 1e3:.2f} ms")
    print("gloo one-way: " + ", ".join(f"{b >> 10} KiB {x * 1e6:.0f} us"
                                       for b, x in zip(comm_sizes, comm_t)))
    for d, m, p in zip(CHECK_BATCHES, whole, predicted):
        print(f"check {len(d):2d} docs {sum(d):5d} tokens: measured {m:.3f} s, fitted preset "
              f"predicts {p:.3f} s ({100 * (p - m) / m:+.0f}%)")
    print(f"TimeModel.calibrate (whole-model check runs): {tm}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the measurements and constants here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: one core per rank, as in the 2-process "
                             "CPU runs of this project, and robust to a shared machine)")
    args = parser.parse_args(argv)
    run = results_io.start()
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 9
    att_s = [64, 128, 256, 512, 1024, 2048] + ([] if args.quick else [3072, 4096])
    lin_tokens = [64, 256, 1024, 2048, 4096] + ([] if args.quick else [8192])
    tiny = [[OVERHEAD_LEN] * k for k in OVERHEAD_DOCS]
    # One interleaved pool: every measurement sees the same load on a shared machine.
    fns = (attention_runs(att_s) + linear_runs(lin_tokens) + whole_model_runs(tiny)
           + whole_model_runs(CHECK_BATCHES))
    times = best_times(fns, reps)
    i, j, k = len(att_s), len(att_s) + len(lin_tokens), len(att_s) + len(lin_tokens) + len(tiny)
    att_t, lin_t, tiny_t, whole = times[:i], times[i:j], times[j:k], times[k:]
    comm_sizes = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
    comm_t = measure_comm(comm_sizes, reps)
    fitted, kernel_call = fit_compute(att_s, att_t, lin_tokens, lin_t)
    fitted = fit_overheads(fitted, tiny, tiny_t)
    # Running maximum: a larger message never takes less time (noise can say otherwise).
    mono = np.maximum.accumulate(np.asarray(comm_t))
    comm = CommModel(sizes_bytes=tuple(float(x) for x in comm_sizes),
                     seconds=tuple(float(x) for x in mono))
    busbw = 1.0 / comm.linear_fit()[1]  # P2P bandwidth bounds a ring all-reduce's bus bandwidth
    fitted = dataclasses.replace(fitted, intra_node_comm=comm, inter_node_comm=comm,
                                 grad_busbw_intra=busbw, grad_busbw_inter=busbw)
    predicted = [_predict_one(fitted, d) for d in CHECK_BATCHES]
    tm = TimeModel.calibrate(TINY_SPEC, CHECK_BATCHES, whole)
    print_report(fitted, kernel_call, comm_sizes, comm_t, whole, predicted, tm)
    report = {
        "attention": {"lengths": att_s, "seconds": att_t},
        "linear": {"tokens": lin_tokens, "seconds": lin_t},
        "overhead_runs": {"documents": list(OVERHEAD_DOCS), "seconds": tiny_t},
        "whole_model": {"batches": CHECK_BATCHES, "seconds": whole, "predicted": predicted},
        "comm": {"bytes": comm_sizes, "seconds": comm_t},
        "preset": {k: v for k, v in dataclasses.asdict(fitted).items()
                   if k not in ("intra_node_comm", "inter_node_comm")},
        "comm_points": {"sizes_bytes": list(comm.sizes_bytes), "seconds": list(comm.seconds)},
        "time_model": dataclasses.asdict(tm),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    results_io.record("calibrate_cpu", report, run, argv)


if __name__ == "__main__":
    main()
