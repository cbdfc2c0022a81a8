"""Launcher: ``torchrun --nproc-per-node N -m megatron.skrull.pretrain_gpt <Megatron flags>``.

Also runs as a single process without torchrun (world size 1, a file store in a temporary
directory, no port).  Invalid flags print one ``error:`` line per problem and exit 2.

Steps: parse flags -> CPU shims (CPU only) -> ``torch.distributed`` (gloo on CPU, NCCL on
GPU; gloo there too with ``SKRULL_DIST_BACKEND=gloo``) ->
``parallel_state.initialize_model_parallel(TP, CP)`` -> seeds -> data source, model, mcore DDP
+ optimizer + LR schedule, sampler, batch scheduler -> optional ``--load`` -> train (log,
TensorBoard, ``--save`` every ``--save-interval`` and at the end).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import signal
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

import skrull_ext
from skrull_ext.attention.comm import RingComm

from megatron.skrull import errors
from megatron.skrull.arguments import ConfigError, RunConfig, parse_args
from megatron.skrull.cpu_compat import (apply_cpu_compat, apply_gloo_cuda_compat, keep_float64,
                                        resolve_device)
from megatron.skrull.run_control import PROGRAM_START  # noqa: F401 - taken at start-up

logger = logging.getLogger("megatron.skrull")


#: ``SKRULL_DIST_BACKEND=gloo`` runs CUDA ranks over gloo, so several can share one GPU
#: (function, not speed: the one-GPU CP checks of ``tools/check_gpu.py``).
DIST_BACKEND_ENV = "SKRULL_DIST_BACKEND"


def dist_backend(device: torch.device, cfg: Optional[RunConfig] = None) -> str:
    """The process-group backend: gloo on CPU; NCCL on CUDA unless ``$SKRULL_DIST_BACKEND``
    is ``gloo`` (ranks may then share a GPU; the ring stages through host memory).

    Raises:
        ValueError: An unknown backend, NCCL without CUDA, more local ranks than GPUs under
            NCCL, or overlapped gradient reduction over gloo on CUDA (naming the fix).
    """
    name = os.environ.get(DIST_BACKEND_ENV, "").strip().lower()
    name = name or ("nccl" if device.type == "cuda" else "gloo")
    if name not in ("nccl", "gloo") or (name == "nccl" and device.type != "cuda"):
        raise ValueError(f"{DIST_BACKEND_ENV}={name}: use gloo (any device) or nccl (CUDA)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if name == "nccl" and local > torch.cuda.device_count():
        raise ValueError(f"{local} processes per node but {torch.cuda.device_count()} GPU(s): "
                         "NCCL cannot run two ranks on one GPU; launch one process per GPU, "
                         f"or set {DIST_BACKEND_ENV}=gloo for a functional (slow) run")
    if name == "gloo" and device.type == "cuda" and cfg is not None and (
            cfg.optim.overlap_grad_reduce or cfg.optim.overlap_param_gather):
        raise ValueError(f"{DIST_BACKEND_ENV}=gloo on CUDA cannot overlap the gradient "
                         "reduction: drop --overlap-grad-reduce / --overlap-param-gather")
    return name


def init_distributed(device: torch.device, init_method: Optional[str] = None,
                     timeout_minutes: int = 10) -> None:
    """Initialises the default process group from torchrun's env (or a world of 1);
    collectives time out after ``timeout_minutes`` (``--distributed-timeout-minutes``)."""
    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if init_method is None:
        if "MASTER_ADDR" in os.environ:
            init_method = "env://"
        elif world == 1:
            init_method = f"file://{tempfile.mkdtemp(prefix='skrull-store-')}/store"
        else:
            raise RuntimeError(f"WORLD_SIZE={world} without MASTER_ADDR: launch with torchrun")
    backend = dist_backend(device)
    if device.type == "cuda":  # over gloo, ranks may share a GPU
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count() if backend == "gloo" else local)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    if backend == "gloo" and device.type == "cuda":
        apply_gloo_cuda_compat()


def init_model_parallel(cfg: RunConfig, device: torch.device) -> None:
    """mcore parallel state and seeds (same init on every rank; TP ranks get own streams)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        context_parallel_size=cfg.parallel.context_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        create_gloo_process_groups=device.type == "cpu",
        distributed_timeout_minutes=cfg.run.distributed_timeout_minutes)
    torch.manual_seed(cfg.optim.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.optim.seed)


def build_sample_source(cfg: RunConfig):
    """The training source: ``--mock-data`` or ``--data-path`` (its ``--split`` train part).

    With ``--tokenizer-type``/``--tokenizer-model`` the dataset must have been tokenized
    with that tokenizer; every sample must fit ``--seq-length``
    (:func:`megatron.skrull.data.build_sample_sources`).
    """
    from megatron.skrull.data import build_sample_sources

    return build_sample_sources(cfg).train


def build_trainer(cfg: RunConfig, device: torch.device, *, source: Any = None,
                  batch_scheduler: Optional[Callable] = None,
                  attention_fn: Optional[Callable] = None):
    """Model (mcore DDP), optimizer, LR schedule, sampler and batch scheduler on a parallel state.

    Args:
        cfg: The run.
        device: Training device.
        source: Sample source (default: :func:`build_sample_source`).
        batch_scheduler: ``lengths -> Plan`` (default:
            :func:`megatron.skrull.batch_schedule.make_batch_scheduler`).
        attention_fn: Replacement of ``dacp_attention`` (tests).

    Returns:
        A :class:`megatron.skrull.training.Trainer` at iteration 0.
    """
    from megatron.skrull.batch_size import GlobalBatchSizes
    from megatron.skrull.batch_size_samplers import scheduled_sampler
    from megatron.skrull.lookahead import lookahead_sampler
    from megatron.skrull.model import build_model
    from megatron.skrull.optimizer import build_optimizer, build_scheduler, wrap_ddp
    from megatron.skrull.batch_schedule import make_batch_scheduler, model_spec
    from megatron.skrull.training import ParallelGroups, Trainer
    from megatron.skrull.vocab import padded_vocab_size
    from skrull_ext.costmodel.flops import model_flops

    source = source if source is not None else build_sample_source(cfg)
    keep_float64(cfg.fp64)  # only --fp64 keeps float64 through mcore's .float() (CPU)
    tp = cfg.parallel.tensor_model_parallel_size
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < source.vocab_size:
        raise ValueError(f"--vocab-size {cfg.model.vocab_size} is smaller than the data's "
                         f"vocabulary {source.vocab_size}; drop --vocab-size or raise it")
    vocab = padded_vocab_size(cfg, source.vocab_size)  # a resumed model keeps its own
    attention_kernel = _attention_kernel(cfg, device)
    model = build_model(cfg.model, vocab_size=vocab, tp_size=tp,
                        cp_size=cfg.parallel.context_parallel_size, dtype=cfg.params_dtype,
                        device=device, attention_fn=attention_fn, recompute=cfg.recompute,
                        pp_size=cfg.parallel.pipeline_model_parallel_size,
                        sequence_parallel=cfg.sequence_parallel_active,
                        transformer_impl=cfg.run.transformer_impl)
    if cfg.checkpoint.pretrained_hf:  # before DDP and the optimizer copy anything
        _load_pretrained_hf(cfg, model)
    ddp = wrap_ddp(model, cfg.optim, grad_reduce_in_fp32=cfg.bf16 or cfg.fp16, device=device)
    optimizer = build_optimizer(ddp, cfg.optim, params_dtype=cfg.params_dtype, bf16=cfg.bf16,
                                fp16=cfg.fp16, device=device)
    _wire_schedule_hooks(cfg, ddp, optimizer)
    groups = ParallelGroups.from_parallel_state()
    if groups.cp_size > 1:
        # NCCL: the CP group's first batched P2P call must involve all its ranks, and a
        # plan may open with a micro-batch of CP sub-group rings only (docs/attention.md).
        RingComm(groups.cp_group).warm_up(device)
    sizes = GlobalBatchSizes(cfg.run.batch_sizes) if cfg.run.batch_sizes else None
    batch_scheduler = batch_scheduler or make_batch_scheduler(cfg, vocab)
    sampler = scheduled_sampler(source, cfg.global_batch_size, cfg.optim.seed, sizes)
    return Trainer(
        model=ddp, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, batch_sizes=cfg.run.batch_sizes),
        source=source, batch_sizes=sizes,
        sampler=lookahead_sampler(sampler, source.lengths, cfg.skrull.lookahead, batch_scheduler),
        batch_scheduler=batch_scheduler,
        groups=groups, device=device,
        float64_loss=cfg.fp64 and tp == 1, plan_ahead=cfg.skrull.plan_ahead,
        attention_backend=attention_kernel,
        pad_multiple=tp if cfg.sequence_parallel_active else 1,
        flops_fn=functools.partial(model_flops, model_spec(cfg, vocab)))


def _load_pretrained_hf(cfg: RunConfig, model) -> None:
    """``--pretrained-hf``'s weights into ``model`` (this TP rank's slices; a pipeline
    stage's layers renamed to the whole model's)."""
    from megatron.core import parallel_state as ps
    from megatron.skrull.hf.io import load_pretrained

    rename = None
    if cfg.parallel.pipeline_model_parallel_size > 1:
        from megatron.skrull.pipeline import whole_model_name

        rename = whole_model_name(model)
    load_pretrained(model, cfg.checkpoint.pretrained_hf, cfg.model,
                    tp_rank=ps.get_tensor_model_parallel_rank(),
                    tp_size=cfg.parallel.tensor_model_parallel_size, rename=rename)


def _wire_schedule_hooks(cfg: RunConfig, ddp, optimizer) -> None:
    """What Megatron's training.py wires into the model config for its schedules."""
    from megatron.core.distributed import finalize_model_grads

    config = ddp.config
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if cfg.optim.overlap_param_gather:
        config.param_sync_func = ddp.start_param_sync


def _attention_kernel(cfg: RunConfig, device: torch.device) -> str:
    """Resolves ``--skrull-attention-kernel`` now, so a missing library stops the launch."""
    from skrull_ext.attention import get_kernel

    try:
        name = get_kernel(cfg.skrull.attention_kernel, device, torch.float32).name
    except RuntimeError as exc:  # the kernel's library is missing: exit 2 naming the fix
        raise ValueError(f"--skrull-attention-kernel {cfg.skrull.attention_kernel}: {exc}") from exc
    half = cfg.bf16 or cfg.fp16
    if device.type == "cuda" and name in ("torch", "flash") and not half:
        raise ValueError(f"--skrull-attention-kernel {cfg.skrull.attention_kernel} runs the "
                         f"{name} kernel, fp16/bf16 only on CUDA: add --bf16 (or --fp16), or "
                         "use --skrull-attention-kernel reference (float64, slow)")
    return name


class ExitSignalHandler:
    """Megatron's ``--exit-signal-handler``: SIGTERM sets a flag, and at the next iteration
    boundary every rank learns (one MAX all-reduce) whether any rank received it."""

    def __init__(self, device: torch.device, sig: int = signal.SIGTERM):
        self.device, self.received = device, False
        signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __call__(self, trainer) -> bool:
        flag = torch.tensor([int(self.received)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            logger.warning("SIGTERM received: saving a checkpoint of iteration %d and exiting",
                           trainer.iteration)
        return bool(flag.item())


def _exit_fn(cfg: RunConfig, device: torch.device):
    """``--exit-signal-handler`` (``--exit-signal``) and ``--exit-duration-in-mins``."""
    from megatron.skrull.run_control import ExitDuration, any_exit

    minutes = cfg.run.exit_duration_in_mins
    return any_exit([
        ExitSignalHandler(device, getattr(signal, cfg.run.exit_signal))
        if cfg.checkpoint.exit_signal_handler else None,
        ExitDuration(minutes, device) if minutes else None])


def _megatron_logging(cfg: RunConfig, metrics, evaluator, description: dict, rank: int,
                      printer: Callable[[str], None]) -> None:
    """Rank 0: the notes on accepted Megatron-LM flags, wandb, timers and validation PPL
    in TensorBoard (``--log-timers-to-tensorboard``, ``--log-validation-ppl-to-tensorboard``)."""
    if rank != 0:
        return
    for note in cfg.run.notes:
        printer(f" skrull: {note}")
    metrics.log_timers = cfg.logging.log_timers_to_tensorboard
    if evaluator is not None:
        evaluator.log_ppl = cfg.logging.log_validation_ppl_to_tensorboard
    if cfg.logging.wandb_project:
        from megatron.skrull.loggers import Writers, open_wandb

        metrics.writer = Writers(metrics.writer,
                                 open_wandb(cfg.logging, cfg.checkpoint.save, description))


class SetupError(RuntimeError):
    """Bad input found while building the run (data, tokenizer, checkpoint): exit 2."""


def setup(cfg: RunConfig, *, init_method: Optional[str] = None):
    """Distributed state, trainer, optional ``--load`` and validation:
    ``(trainer, meta, device, evaluator)`` (``evaluator``: ``None`` without validation).

    Raises:
        SetupError: The data, tokenizer, vocabulary or checkpoint do not fit the flags
            (the message names the fix).
    """
    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.data import DatasetFormatError, build_sample_sources
    from megatron.skrull.evaluation import build_evaluator

    device = resolve_device(cfg.device)
    apply_cpu_compat(device)
    init_distributed(device, init_method, cfg.run.distributed_timeout_minutes)
    init_model_parallel(cfg, device)
    try:
        sources = build_sample_sources(cfg)
        if cfg.run.eod_mask_loss:
            from megatron.skrull.run_control import mask_eod

            sources = mask_eod(sources)
        trainer = build_trainer(cfg, device, source=sources.train)
        evaluator = build_evaluator(cfg, sources, trainer.batch_scheduler, device=device)
        meta = ckpt.CheckpointMeta.from_parallel_state(device)
        if cfg.checkpoint.load:
            c = cfg.checkpoint  # a checkpoint of this run in --load wins over --pretrained-hf
            ckpt.load_checkpoint(c.load, trainer, meta, dataclasses.asdict(cfg),
                                 finetune=c.finetune, load_optim=not c.no_load_optim,
                                 load_rng=not c.no_load_rng,
                                 allow_missing=c.load == c.save or bool(c.pretrained_hf))
    except (DatasetFormatError, FileNotFoundError, ValueError) as exc:
        raise SetupError(str(exc)) from exc
    return trainer, meta, device, evaluator


def run(cfg: RunConfig, *, init_method: Optional[str] = None,
        printer: Callable[[str], None] = print) -> list:
    """Everything after flag parsing; returns the iteration stats."""
    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.evaluation import attach, describe
    from megatron.skrull.training import MetricsLogger, train

    trainer, meta, device, evaluator = setup(cfg, init_method=init_method)
    description = dataclasses.asdict(cfg)
    save_fn = None
    if cfg.checkpoint.save:
        save_fn = lambda t: ckpt.save_checkpoint(cfg.checkpoint.save, t, meta, description)  # noqa: E731
        if meta.rank == 0:  # what tools/export_hf.py needs besides weights, any ckpt format
            from megatron.skrull.hf.export import record_run

            record_run(cfg.checkpoint.save, description)
    metrics = MetricsLogger(log_interval=cfg.logging.log_interval,
                            train_iters=cfg.optim.train_iters, enabled=meta.rank == 0,
                            tensorboard_dir=cfg.logging.tensorboard_dir, printer=printer,
                            log_throughput=cfg.logging.log_throughput,
                            world_size=cfg.parallel.world_size)
    _megatron_logging(cfg, metrics, evaluator, description, meta.rank, printer)
    if meta.rank == 0:
        printer(f" skrull: world {cfg.parallel.world_size} = DP {cfg.parallel.dp_size} x CP "
                f"{cfg.parallel.context_parallel_size} x TP "
                f"{cfg.parallel.tensor_model_parallel_size}"
                + (f" x PP {cfg.parallel.pipeline_model_parallel_size}"
                   if cfg.parallel.pipeline_model_parallel_size > 1 else "")
                + f" on {device.type}, "
                f"{sum(p.numel() for p in trainer.params)} parameters per rank, "
                f"starting at iteration {trainer.iteration}; scheduler "
                f"{cfg.skrull.scheduler} on the {skrull_ext.BACKEND} backend"
                + (f" ({cfg.skrull.objective} objective)" if cfg.skrull.scheduler == "skrull"
                   else "")
                + (f", lookahead windows of {cfg.skrull.lookahead} global batches"
                   if cfg.skrull.lookahead > 1 else "")
                + (", cost model refitted online" if trainer.batch_scheduler.refit is not None
                   else ""))
        precision = ("fp64" if cfg.fp64 else "bf16" if cfg.bf16 else "fp16" if cfg.fp16
                     else "fp32")
        printer(f" skrull: {precision} params, distributed optimizer "
                f"{'on' if cfg.optim.use_distributed_optimizer else 'off'}, recompute "
                f"{cfg.recompute.recompute_granularity or 'none'}, sequence parallel "
                f"{'on' if cfg.sequence_parallel_active else 'off'}; --micro-batch-size "
                f"{cfg.micro_batch_size} ignored: the scheduler packs each micro-batch to "
                f"--skrull-bucket-size {cfg.skrull.bucket_size} tokens per CP rank")
        if cfg.model.rope_type != "default" or cfg.model.rotary_percent != 1.0:
            from megatron.skrull.rope import describe

            printer(f" skrull: {describe(cfg.model, cfg.model.max_position_embeddings)}")
        if cfg.parallel.hybrid_context_parallel:
            printer(f" skrull: Megatron's hybrid/dynamic CP: the DP x CP ranks form one pool "
                    f"of {cfg.parallel.context_parallel_size} (CP here, as Megatron shards each "
                    f"sample over a power-of-two group of them), "
                    f"{cfg.skrull.bucket_size} tokens per rank, policy {cfg.skrull.scheduler}")
        if cfg.sequence_parallel and not cfg.sequence_parallel_active:
            # Megatron's arguments.py does the same at TP = 1.
            printer(" skrull: warning: disabling --sequence-parallel because tensor model "
                    "parallelism is disabled (--tensor-model-parallel-size 1)")
        if evaluator is not None:
            printer(describe(evaluator))
        from megatron.skrull.blend import ConcatSource, describe_blend

        if isinstance(trainer.source, ConcatSource):  # a weighted blend
            printer(describe_blend(trainer.source))
    metrics.dataset_counts = getattr(trainer.sampler.sampler, "consumed_per_dataset", None)
    try:
        exit_fn = _exit_fn(cfg, device)
        return train(trainer, train_iters=cfg.optim.train_iters, metrics=metrics,
                     save_interval=cfg.checkpoint.save_interval, save_fn=save_fn,
                     exit_fn=exit_fn, exit_interval=cfg.exit_interval,
                     evaluator=attach(evaluator, metrics))
    finally:
        metrics.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``skrull-pretrain-gpt``); returns the exit status.

    Bad flags, data, tokenizer or checkpoint: one ``error:`` line per problem, status 2;
    under torchrun from rank 0 only (every rank parses the same flags and reads the same
    data, so all find the problem before any collective), the others exit 2 silently.
    Any other failure: one ``error:`` line from the failing rank, status 1; ``--debug`` or
    ``SKRULL_DEBUG=1`` shows the traceback (see :mod:`megatron.skrull.errors`).
    """
    argv, debug = errors.take_debug_flag(argv)
    errors.filter_dependency_warnings()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = errors.parse_quietly(lambda a: parse_args(a, world_size=world), argv)
        dist_backend(resolve_device(cfg.device), cfg)
    except SystemExit as exc:  # argparse (already reported on rank 0) or --help
        return exc.code if isinstance(exc.code, int) else errors.EXIT_BAD_INPUT
    except ConfigError as exc:
        return errors.report(exc.problems)
    except ValueError as exc:
        return errors.report([str(exc)])
    rank0 = errors.env_rank() == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    printer = (lambda s: print(s, flush=True)) if rank0 else (lambda s: None)
    try:
        run(cfg, printer=printer)
    except SetupError as exc:
        if debug:
            raise
        return errors.report([str(exc)])
    except Exception as exc:  # noqa: BLE001 - the entry point turns any failure into status 1
        return errors.report_failure(exc, debug=debug)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
