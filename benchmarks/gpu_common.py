"""Shared pieces of the GPU benchmarks: model shapes, the launcher in-process, timing, budget.

Used by ``calibrate_gpu.py``, ``bench_gpu.py`` and ``bench_memory.py --device cuda``.  Each
of them also runs with ``--device cpu`` on the ``tiny`` shape, which is how the tests drive
them (no test needs CUDA).  The launcher runs in this process as ``megatron.skrull.
pretrain_gpt`` builds it (:func:`megatron.skrull.pretrain_gpt.setup`: world 1, a file store,
NCCL on CUDA, gloo on CPU), so every measured iteration is the launcher's own
``Trainer.run_plan`` / ``train``.
"""
from __future__ import annotations

import datetime
import gc
import os
import platform
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Launcher model flags of the shapes the issue names (Hugging Face configs of Qwen2.5-0.5B
# and -1.5B: GQA, QKV bias, SwiGLU, RMSNorm 1e-6, RoPE base 1e6, tied embeddings, vocabulary
# 151936), and a tiny one for CPU tests.
_QWEN = ["--add-qkv-bias", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--disable-bias-linear", "--rotary-base", "1000000", "--vocab-size", "151936"]
SHAPES = {
    "qwen2.5-0.5b": ["--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
                     "--num-attention-heads", "14", "--group-query-attention",
                     "--num-query-groups", "2", *_QWEN],
    "qwen2.5-1.5b": ["--num-layers", "28", "--hidden-size", "1536", "--ffn-hidden-size", "8960",
                     "--num-attention-heads", "12", "--group-query-attention",
                     "--num-query-groups", "2", *_QWEN],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
             "--add-qkv-bias",
             "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
             "--vocab-size", "256"],
}


def flag_value(argv: Sequence[str], flag: str, default: Optional[str] = None):
    """The value of the last ``flag VALUE`` in ``argv`` (argparse's rule), else ``default``."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values[-1] if values else default


def launcher_argv(shape: Optional[str], extra: Sequence[str], *, seq_length: int,
                  bucket: int, global_batch: int = 16) -> list[str]:
    """Launcher flags: ``shape``'s model, then defaults for a timing run, then ``extra``
    (later flags win, so ``extra`` overrides the defaults and the shape); on CUDA ``--bf16``
    unless ``extra`` names a precision."""
    from megatron.skrull.cpu_compat import resolve_device

    extra = list(extra)
    data = [] if any(a.startswith("--data-path") for a in extra) else [
        "--mock-data", "--mock-num-samples", "4096"]
    precision = [] if {"--bf16", "--fp16", "--fp64"} & set(extra) or resolve_device(
        flag_value(extra, "--device", "auto")).type != "cuda" else ["--bf16"]
    return [*(SHAPES[shape] if shape else []), "--seq-length", str(seq_length),
            "--skrull-bucket-size", str(bucket), "--global-batch-size", str(global_batch),
            "--lr", "1e-5", "--lr-warmup-iters", "0", "--train-iters", "1000000",
            "--log-interval", "1", *data, *precision, *extra]


def environment(device: torch.device) -> dict:
    """Where a measurement was taken: date (UTC), device, torch / CUDA / Python versions."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": gpu or f"cpu ({platform.processor() or platform.machine()}, "
                             f"{torch.get_num_threads()} threads)",
            "gpu_memory_gib": (torch.cuda.get_device_properties(device).total_memory / 2**30
                               if gpu else None),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


class Budget:
    """A wall-clock budget split into stages: ``until(f)`` is the deadline of the stage that
    must end by fraction ``f`` of the budget (monotonic seconds)."""

    def __init__(self, seconds: float):
        self.seconds, self.start = float(seconds), time.monotonic()
        self.skipped: list[str] = []

    def until(self, fraction: float) -> float:
        return self.start + fraction * self.seconds

    def used(self) -> float:
        return time.monotonic() - self.start

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        print(f"  skipped (--time-budget-s {self.seconds:.0f}): {what}", flush=True)

    def report(self) -> dict:
        return {"seconds": self.seconds, "used": round(self.used(), 1), "skipped": self.skipped}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(fns: Sequence[Callable[[], None]], device: torch.device, repeats: int,
              deadline: float = float("inf")) -> list[Optional[float]]:
    """Median seconds of each closure over ``repeats`` interleaved runs after one warm-up
    (``A B C A B C ...``); past ``deadline`` no further round starts, but every closure
    has one timed run (``None`` only when ``repeats`` is 0)."""
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(repeats + 1):
        for i, fn in enumerate(fns):
            if time.monotonic() > deadline and rep > 1:
                break
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if rep:
                times[i].append(time.perf_counter() - start)
    return [float(np.median(t)) if t else None for t in times]


def timed(step, items, device, deadline) -> tuple[float, int]:
    """``(seconds, items run)`` of ``step(item)`` over ``items[1:]`` after ``items[0]``
    (warm-up); stops after the first timed item once ``deadline`` has passed."""
    step(items[0])
    seconds, done = 0.0, 0
    for item in items[1:]:
        sync(device)
        start = time.perf_counter()
        step(item)
        sync(device)
        seconds += time.perf_counter() - start
        done += 1
        if time.monotonic() > deadline:
            break
    return seconds, done


def start_run(argv: Sequence[str]):
    """``(cfg, trainer, vocab)`` of the launcher on these flags, built in this process."""
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.pretrain_gpt import setup

    cfg = parse_args(list(argv), world_size=1)
    trainer = setup(cfg)[0]
    vocab = cfg.model.padded_vocab_size(cfg.model.vocab_size or trainer.source.vocab_size, 1)
    return cfg, trainer, vocab


def training_memory(cfg, device: torch.device, recompute: Optional[str]):
    """The :class:`TrainingMemory` of this run (precision, recompute, the device's norm)."""
    from skrull_ext.costmodel.memory import TrainingMemory, norm_for

    precision = {torch.bfloat16: "bf16", torch.float16: "fp16",
                 torch.float64: "fp64"}.get(cfg.params_dtype, "fp32")
    return TrainingMemory(precision=precision, recompute=recompute,
                          norm=norm_for(device.type, cfg.model.normalization))


def stop_run() -> None:
    """Tears down what :func:`start_run` set up (model-parallel state, process group) and
    returns the memory, so the next run starts from an empty device."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    free_memory()


def free_memory() -> None:
    """Drops unreachable tensors and returns cached device memory to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fill(lengths: np.ndarray, order: np.ndarray, tokens: int, cap: int) -> np.ndarray:
    """Ids from ``order`` (dataset ids in preference order) whose lengths add up to at most
    ``tokens``, each at most ``cap`` long, taken while they fit (at least one)."""
    out, total = [], 0
    for i in order:
        s = int(lengths[i])
        if s <= cap and total + s <= tokens:
            out.append(int(i))
            total += s
    if not out:
        out.append(int(next(i for i in order if lengths[i] <= cap)))
    return np.asarray(out, dtype=np.int64)


def plan_for(lengths, cost, bucket: int, policy: str = "skrull"):
    """The scheduler's plan of one global batch on one GPU (DP = CP = 1)."""
    from skrull_ext.scheduler import SchedulerConfig, schedule

    return schedule(np.asarray(lengths, dtype=np.int64),
                    SchedulerConfig(dp_size=1, cp_size=1, bucket_size=bucket, policy=policy),
                    cost)


def run_plans(trainer, cases, device: torch.device, repeats: int,
              deadline: float = float("inf")) -> list[Optional[float]]:
    """Median seconds of ``trainer.run_plan`` (gradients, clip, AdamW) per ``(ids, plan)``
    case over ``repeats`` interleaved runs after one warm-up round."""
    fns = [lambda ids=ids, plan=plan: trainer.run_plan(ids, plan) for ids, plan in cases]
    return time_runs(fns, device, repeats, deadline)


def summarize_errors(measured: Sequence[float], predicted: Sequence[float]) -> dict:
    """``predicted / measured - 1`` per item, its median / mean / max of the absolute value,
    and the error of the totals."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    if m.size == 0:
        return {"n": 0}
    err = p / m - 1.0
    return {"n": int(m.size), "median_abs_pct": float(100 * np.median(np.abs(err))),
            "mean_abs_pct": float(100 * np.mean(np.abs(err))),
            "max_abs_pct": float(100 * np.max(np.abs(err))),
            "total_pct": float(100 * (p.sum() / m.sum() - 1.0))}

