"""Times real training iterations of the launcher's stack in-process (no torchrun).

Used by ``calibrate_training_cpu.py``, ``validate_training_cpu.py`` and ``bench_e2e_cpu.py``.
:func:`run_cases` spawns ``world`` gloo workers (file store, one thread each, as torchrun
gives every rank ``OMP_NUM_THREADS=1``); each builds the run exactly as
``megatron.skrull.pretrain_gpt`` does (:func:`megatron.skrull.pretrain_gpt.setup`) and
then runs :meth:`Trainer.run_plan` -- gradients, all-reduce, clip, AdamW -- for every
``(batch ids, plan)`` case, round-robin over the cases (``A B C A B C ...``) so machine
noise hits all of them alike.  A case's time is the slowest rank's wall time of the
iteration, after a barrier.  Start-up (~10 s) is paid once per spawn, not per run.

With ``breakdown=True`` the workers also split each iteration (benchmark-side wrappers;
the library is not instrumented):

* ``data``: packing the rank's micro-batches (:func:`megatron.skrull.training.materialize`);
* ``attn_local``: kernel calls on local documents (held whole);
* ``attn_ring``: kernel calls inside the zigzag ring (distributed documents);
* ``ring_wait``: time blocked in ``RingComm.wait`` (exposed P2P communication);
* ``ring_other``: the rest of the ring (log-sum-exp merges, index selects, posting);
* ``grad_allreduce``: the DP x CP gradient all-reduce;
* ``optimizer``: mcore's optimizer step (clipping and AdamW);
* ``model_other``: everything else: embedding, norms, QKV/output projections, MLP, RoPE,
  loss, autograd (the "linear" part of the cost model).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PARTS = ("data", "attn_local", "attn_ring", "ring_wait", "ring_other", "linear",
         "grad_allreduce", "optimizer", "model_other")

# mcore's linear layers (QKV, output projection, MLP fc1/fc2, LM head): timed as "linear".
LINEAR_CLASSES = ("ColumnParallelLinear", "RowParallelLinear")


def make_corpus(directory: str, *, num_samples: int = 2000, seed: int = 1,
                seq_length: int = 16384) -> str:
    """The bundled synthetic long-tail SFT corpus, preprocessed; returns the data prefix."""
    from megatron.skrull.preprocess import main as preprocess_main

    prefix = os.path.join(directory, f"synth-{num_samples}-{seed}-{seq_length}")
    if not os.path.exists(prefix + ".bin"):
        with open(os.devnull, "w") as null:
            import contextlib

            with contextlib.redirect_stdout(null):
                rc = preprocess_main(["--synthetic", str(num_samples), "--seed", str(seed),
                                      "--seq-length", str(seq_length), "--output-prefix", prefix])
        if rc:
            raise RuntimeError(f"preprocess_sft failed with status {rc}")
    return prefix


def load_run(argv: Sequence[str], world: int):
    """``(cfg, source, vocab)`` of a launcher command line, without starting anything."""
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.pretrain_gpt import build_sample_source

    cfg = parse_args(list(argv), world_size=world)
    source = build_sample_source(cfg)
    vocab = cfg.model.padded_vocab_size(cfg.model.vocab_size or source.vocab_size,
                                        cfg.parallel.tensor_model_parallel_size)
    return cfg, source, vocab


class _Timers:
    """Benchmark-side wrappers around the attention, ring and training-loop functions."""

    def __init__(self):
        self.acc = dict.fromkeys(PARTS, 0.0)
        self.phase = "local"
        self.in_ring = 0.0

    def add(self, key, seconds):
        self.acc[key] += seconds

    def install(self, trainer):
        """Wraps the trainer's kernels, ring, data, all-reduce, optimizer and linear layers."""
        self._time_kernels(trainer)
        self._time_ring()
        self._time_loop(trainer)
        self._time_linears(trainer.model)

    def _time_kernels(self, trainer):
        """Attention kernel calls, by phase (local work or inside the ring)."""
        from skrull_ext.attention import AttentionKernel, get_kernel

        timers = self
        inner = get_kernel("auto", trainer.device, trainer.params[0].dtype)

        class TimedKernel(AttentionKernel):
            name = "timed"

            def forward(self, *a, **k):
                t = time.perf_counter()
                r = inner.forward(*a, **k)
                timers.add("attn_" + timers.phase, time.perf_counter() - t)
                return r

            def backward(self, *a, **k):
                t = time.perf_counter()
                r = inner.backward(*a, **k)
                timers.add("attn_" + timers.phase, time.perf_counter() - t)
                return r

        trainer.attention_backend = TimedKernel()

    def _time_ring(self):
        """Ring functions (minus the local work run inside them) and their waits."""
        from skrull_ext.attention import comm as comm_mod
        from skrull_ext.attention import function as fn_mod

        timers = self

        def ring_wrap(orig):
            def run(*a, during_first_exchange=None, **k):
                def local():
                    timers.phase = "local"
                    t = time.perf_counter()
                    during_first_exchange()
                    timers.in_ring -= time.perf_counter() - t
                    timers.phase = "ring"
                timers.phase = "ring"
                t = time.perf_counter()
                try:
                    return orig(*a, during_first_exchange=local if during_first_exchange
                                else None, **k)
                finally:
                    timers.in_ring += time.perf_counter() - t
                    timers.phase = "local"
            return run

        fn_mod.ring_forward = ring_wrap(fn_mod.ring_forward)
        fn_mod.ring_backward = ring_wrap(fn_mod.ring_backward)
        wait = comm_mod.RingComm.wait

        def timed_wait(comm, channel="fwd_kv"):
            t = time.perf_counter()
            wait(comm, channel)
            timers.add("ring_wait", time.perf_counter() - t)

        comm_mod.RingComm.wait = timed_wait

    def _time_loop(self, trainer):
        """Data packing, mcore's gradient reduction and its optimizer step (with clipping)."""
        from megatron.skrull import training as tr

        timers = self

        def timed(orig, key):
            def run(*a, **k):
                t = time.perf_counter()
                r = orig(*a, **k)
                timers.add(key, time.perf_counter() - t)
                return r
            return run

        tr.materialize = timed(tr.materialize, "data")
        config = trainer.model.config
        config.finalize_model_grads_func = timed(config.finalize_model_grads_func,
                                                 "grad_allreduce")
        trainer.optimizer.step = timed(trainer.optimizer.step, "optimizer")

    def _time_linears(self, model):
        """Forward and backward of every linear layer into ``linear``.

        Forward: module pre-hook to hook.  Backward: tensor hooks (module backward hooks
        would wrap the logits in a view that mcore's in-place cross entropy rejects): from the
        gradient of the output being ready to the gradient of the input being done; every
        timed layer's input has that layer as its only consumer, and with one thread the
        autograd engine runs the layer's backward in between (plus at most a residual add).
        """
        timers = self
        start = {}

        def begin(module, args):
            start[id(module)] = time.perf_counter()

        def end(module, args, output):
            timers.add("linear", time.perf_counter() - start.pop(id(module)))
            out = output[0] if isinstance(output, tuple) else output
            x = args[0] if args else None
            if not (torch.is_tensor(out) and out.requires_grad and torch.is_tensor(x)
                    and x.requires_grad):
                return
            t0 = []
            out.register_hook(lambda g: t0.append(time.perf_counter()))
            x.register_hook(lambda g: timers.add("linear", time.perf_counter() - t0.pop())
                            if t0 else None)

        for module in model.modules():
            if type(module).__name__ in LINEAR_CLASSES:
                module.register_forward_pre_hook(begin)
                module.register_forward_hook(end)

    def take(self, total: float) -> dict:
        """This iteration's split (seconds); resets the accumulators."""
        out = dict(self.acc)
        out["ring_other"] = max(self.in_ring - out["attn_ring"] - out["ring_wait"], 0.0)
        out["model_other"] = total - sum(v for k, v in out.items() if k != "model_other")
        self.acc = dict.fromkeys(PARTS, 0.0)
        self.in_ring = 0.0
        return out


def _worker(rank, world, store, out_path, argv, cases, repeats, warmup, breakdown):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import logging
    logging.disable(logging.WARNING)
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.pretrain_gpt import setup

    cfg = parse_args(list(argv), world_size=world)
    trainer = setup(cfg, init_method=f"file://{store}")[0]
    timers = _Timers() if breakdown else None
    if timers:
        timers.install(trainer)
    schedulers = {}
    times = [[] for _ in cases]
    parts = [[] for _ in cases]
    for rep in range(warmup + repeats):
        for i, (batch_ids, plan) in enumerate(cases):
            dist.barrier()
            start = time.perf_counter()
            if isinstance(plan, str):  # plan now, as the launcher does (timed)
                if plan not in schedulers:
                    schedulers[plan] = _batch_scheduler(cfg, trainer, plan)
                plan = schedulers[plan](trainer.source.lengths[np.asarray(batch_ids)])
            stats = trainer.run_plan(np.asarray(batch_ids), plan, start=start)
            t = torch.tensor([stats.seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            split = timers.take(stats.seconds) if timers else None
            if rep >= warmup:
                times[i].append(float(t[0]))
                if split is not None:
                    parts[i].append(split)
    every_rank = [None] * world
    dist.all_gather_object(every_rank, parts)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "parts": parts, "parts_by_rank": every_rank}, f)
    dist.barrier()
    dist.destroy_process_group()


def _batch_scheduler(cfg, trainer, policy: str):
    """The launcher's batch scheduler of ``cfg`` with ``--skrull-scheduler policy``."""
    import dataclasses

    from megatron.skrull.batch_schedule import make_batch_scheduler

    vocab = cfg.model.padded_vocab_size(cfg.model.vocab_size or trainer.source.vocab_size,
                                        cfg.parallel.tensor_model_parallel_size)
    run = dataclasses.replace(cfg, skrull=dataclasses.replace(cfg.skrull, scheduler=policy))
    return make_batch_scheduler(run, vocab)


def run_cases(argv: Sequence[str], world: int, cases: list, *, repeats: int = 3,
              warmup: int = 1, breakdown: bool = False, timeout: float = 1800.0) -> dict:
    """Times ``cases`` (``[(batch_ids [K], Plan or policy name)]``) on ``world`` ranks.

    A policy name is planned in the workers by the launcher's batch scheduler (planning timed).

    Returns:
        ``{"times": [case][repeat] seconds, "parts": [case][repeat] {part: seconds},
        "parts_by_rank": [rank][case][repeat] {part: seconds}}`` (``parts`` of rank 0;
        empty lists without ``breakdown``).
    """
    with tempfile.TemporaryDirectory(prefix="skrull-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), out,
                                                list(argv), cases, repeats, warmup, breakdown),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"benchmark workers did not finish within {timeout} s")
        with open(out) as f:
            return json.load(f)


def median(xs) -> float:
    return float(statistics.median(xs))


def model_argv(*, layers: int, hidden: int, heads: int, groups: int, seq_length: int,
               global_batch: int, bucket: int, cp: int, data_path: str,
               extra: Optional[Sequence[str]] = None) -> list[str]:
    """The launcher flags of a benchmark run (SwiGLU, RMSNorm, no biases, fp32)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--group-query-attention",
            "--num-query-groups", str(groups),
            "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--global-batch-size", str(global_batch), "--lr", "1e-4",
            "--train-iters", "1000000", "--context-parallel-size", str(cp),
            "--skrull-bucket-size", str(bucket), "--data-path", data_path, "--device", "cpu",
            *(extra or [])]


# Models of the calibration, validation and end-to-end runs (head dim 64 / 32, GQA 2:1).
MODELS = {
    "h256": dict(layers=2, hidden=256, heads=4, groups=2),
    "h128": dict(layers=2, hidden=128, heads=4, groups=2),
}


def global_batches(source, global_batch: int, seed: int, count: int) -> list[np.ndarray]:
    """The first ``count`` global batches of the launcher's sampler with ``--seed seed``."""
    from megatron.skrull.data import GlobalBatchSampler

    sampler = GlobalBatchSampler(len(source), global_batch, seed)
    return [np.asarray(next(sampler), dtype=np.int64) for _ in range(count)]


def plan_batch(lengths, cost_model, *, dp: int, cp: int, bucket: int, policy: str):
    """A plan of ``policy`` (``skrull``, ``skrull-paper`` = DACP paper variant, baselines)."""
    from skrull_ext.scheduler import SchedulerConfig, schedule

    dacp = "auto"
    if policy == "skrull-paper":
        policy, dacp = "skrull", "paper"
    return schedule(lengths, SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket,
                                             policy=policy, dacp=dacp), cost_model)


def predictions(plan, spec, hardware) -> tuple[float, float]:
    """``(scheduler CostModel prediction, simulator prediction)`` of ``plan`` in seconds."""
    from skrull_ext.scheduler import predict
    from skrull_ext.planner.simulator import simulate

    cost = hardware.cost_model(spec, plan.cp_size, plan.dp_size)
    return (float(predict(plan, cost)["iteration_time"]),
            float(simulate(plan, spec, hardware).iteration_time))
