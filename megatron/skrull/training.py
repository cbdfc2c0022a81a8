"""Skrull training loop: plan the global batch, run this rank's micro-batches, step.

Per iteration every rank (no communication for any of this):

1. takes the next global batch of sample ids from the sampler and their lengths;
2. computes the :class:`~skrull_ext.scheduler.plan.Plan` with the (deterministic) batch scheduler;
3. materialises only its own micro-batches: those of its DP rank, in its CP rank's layout.

The micro-batches run through mcore's ``get_forward_backward_func()`` (the no-pipelining
schedule for PP = 1) with :func:`forward_step`; the loss function returns ``(sum of masked
token losses, loss tokens, report)`` and the model config has ``calculate_per_token_loss``,
so mcore's ``finalize_model_grads`` sums gradients over DP x CP and divides them by the loss
tokens of the whole global batch: the gradient of ``sum(token losses) / global loss tokens``
(docs/training.md).  mcore's optimizer then clips (TP-aware), steps (AdamW, fp32 main params
under bf16/fp16) and ``OptimizerParamScheduler`` sets the next LR.

A rank holding no tokens of a micro-batch runs no model compute for it: such a micro-batch
has no distributed samples (they put tokens on every CP rank), so attention issues no CP
collective, and TP peers share the rank's tokens.  It returns a zero loss that touches every
parameter, so mcore's gradient hooks fire as for any other micro-batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import math
import time
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from skrull_ext.costmodel.flops import throughput_tflops
from skrull_ext.scheduler.plan import Plan

from megatron.skrull.cpu_compat import cpu_pipeline_p2p, cuda_to_cpu, foreach_multi_tensor
from megatron.skrull.micro_batch import MicroBatchInputs, materialize, pad_micro_batch
from megatron.skrull.batch_schedule import BatchScheduler, predicted_seconds
from megatron.skrull.plan_ahead import PlannedBatches, agree_on_plan
from megatron.skrull.samples import SampleSource

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """This rank's coordinates and process groups (passed explicitly, never looked up).

    Attributes:
        dp_rank: Data-parallel rank (which ``plan.dp_ranks`` entry to run).
        cp_rank: Rank inside the CP group (which layout to build).
        cp_size: CP group size.
        cp_group: CP group (attention communication).
        tp_group: Tensor-parallel group.
        grad_group: DP x CP group over which the reported loss is summed (mcore's DDP
            reduces gradients over the same group).
        pp_size: Pipeline stages (> 1: :mod:`megatron.skrull.pipeline` feeds the schedule).
    """

    dp_rank: int = 0
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Optional[dist.ProcessGroup] = None
    tp_group: Optional[dist.ProcessGroup] = None
    grad_group: Optional[dist.ProcessGroup] = None
    pp_size: int = 1

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        """Reads mcore's ``parallel_state`` once (call after ``initialize_model_parallel``)."""
        from megatron.core import parallel_state as ps

        return cls(dp_rank=ps.get_data_parallel_rank(), cp_rank=ps.get_context_parallel_rank(),
                   cp_size=ps.get_context_parallel_world_size(),
                   cp_group=ps.get_context_parallel_group(),
                   tp_group=ps.get_tensor_model_parallel_group(),
                   grad_group=ps.get_data_parallel_group(with_context_parallel=True),
                   pp_size=ps.get_pipeline_model_parallel_world_size())


def masked_loss_sum(loss_mask: Optional[torch.Tensor], output_tensor: torch.Tensor):
    """mcore loss function: ``(sum of masked token losses, loss tokens, report)``.

    Args:
        loss_mask: ``[1, T]`` (``None``: ``output_tensor`` is an empty micro-batch's zero).
        output_tensor: ``[1, T]`` per-token losses.

    Returns:
        The loss sum (backpropagated as is: ``calculate_per_token_loss``), the int count
        of loss tokens, and ``{"lm loss": [loss sum, tokens]}`` (float64, detached), all
        on the loss's device: nothing is read back per micro-batch (a device-to-host copy
        would wait for the micro-batch to finish); :meth:`Trainer.loss_sums` sums them.
    """
    if loss_mask is None:
        total = output_tensor
        count = torch.zeros((), dtype=torch.int, device=output_tensor.device)
    else:
        total = (output_tensor * loss_mask.to(output_tensor.dtype)).sum()
        count = loss_mask.sum().to(torch.int)
    report = torch.stack([total.detach().double(), count.double()])
    return total, count, {"lm loss": report}


def forward_step(data_iterator: Iterator[Optional[MicroBatchInputs]], model: torch.nn.Module,
                 *, float64_loss: bool = False, pad_multiple: int = 1):
    """mcore ``forward_step_func``: one packed micro-batch -> ``(losses [1, T], loss_func)``.

    Args:
        data_iterator: Yields this rank's :class:`MicroBatchInputs` (``None``: no tokens).
        model: The DDP-wrapped model.
        float64_loss: Cross entropy from float64 logits (mcore's is float32; TP = 1 only).
        pad_multiple: Stream length multiple (TP with ``--sequence-parallel``, else 1).
    """
    inputs = pad_micro_batch(next(data_iterator), pad_multiple)
    if inputs is None:
        zero = sum((p.reshape(-1)[:1] * 0).sum() for p in model.parameters())
        return zero, functools.partial(masked_loss_sum, None)
    kwargs = dict(packed_seq_params=inputs.packed_seq_params)
    # Only the last pipeline stage has logits; the others return hidden states.
    if float64_loss and getattr(getattr(model, "module", model), "post_process", True):
        logits = model(inputs.input_ids, inputs.position_ids, None, **kwargs)
        losses = F.cross_entropy(logits[0].double(), inputs.labels[0], reduction="none")[None]
    else:
        losses = model(inputs.input_ids, inputs.position_ids, None, labels=inputs.labels,
                       **kwargs)
    return losses, functools.partial(masked_loss_sum, inputs.loss_mask)


@dataclasses.dataclass(frozen=True)
class IterationStats:
    """What one iteration did (identical on every rank except ``rank_tokens``)."""

    iteration: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    predicted_seconds: Optional[float]
    tokens: int
    micro_batches: int
    local_share: float
    planning_seconds: float = 0.0  # planning the main thread waited for (exposed)
    forward_backward_seconds: float = 0.0  # micro-batches incl. gradient reduction
    optimizer_seconds: float = 0.0  # clip, step, LR schedule
    flops: Optional[float] = None  # model FLOPs of the global batch (skrull_ext.costmodel.flops)
    global_batch_size: int = 0  # samples of the global batch (a batch-size schedule varies it)
    consumed_samples: int = 0  # samples of iterations 1 .. this one (Megatron's counter)
    skipped: bool = False  # the optimizer skipped the update (fp16 overflow)
    loss_scale: float = 1.0  # the optimizer's loss scale (fp16; 1 otherwise)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Trainer:
    """Owns the model, optimizer, data stream and batch scheduler of one run.

    Args:
        model: mcore ``DistributedDataParallel`` around the (TP-sharded) model; its config
            has ``calculate_per_token_loss`` and mcore's sync/finalize hooks set.
        optimizer: ``get_megatron_optimizer``'s optimizer over ``model``.
        scheduler: ``OptimizerParamScheduler`` (stepped once per successful update).
        source: Sample source.
        sampler: Global-batch sampler: ``next(sampler)`` -> sample ids; its
            ``state_dict`` is checkpointed.
        batch_scheduler: ``lengths -> Plan`` (same result on every rank).
        groups: This rank's coordinates and groups.
        device: Training device.
        float64_loss: See :func:`forward_step`.
        attention_backend: ``dacp_attention`` kernel back-end (``"auto"``).
        pad_multiple: See :func:`forward_step` (TP size under sequence parallelism).
        plan_ahead: Plan iteration ``i + 1`` while ``i`` trains
            (:class:`megatron.skrull.plan_ahead.PlannedBatches`; ``self.sampler`` is that
            wrapper, whose checkpoint state undoes the batch drawn ahead).
        flops_fn: ``lengths [K] -> model FLOPs`` of a global batch (``--log-throughput``;
            :func:`skrull_ext.costmodel.flops.model_flops` of the run's shape).
        batch_sizes: The batch-size schedule's
            :class:`~megatron.skrull.batch_size.GlobalBatchSizes` (``None``: constant); with
            one the LR schedule steps by samples, as Megatron-LM's does.
    """

    def __init__(self, *, model, optimizer, scheduler, source: SampleSource, sampler: Any,
                 batch_scheduler: BatchScheduler, groups: ParallelGroups, device: torch.device,
                 float64_loss: bool = False, attention_backend: str = "auto",
                 plan_ahead: bool = False, pad_multiple: int = 1,
                 flops_fn: Optional[Callable[[np.ndarray], float]] = None,
                 batch_sizes: Optional[Any] = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.source, self.sampler, self.batch_scheduler = source, sampler, batch_scheduler
        self.groups, self.device, self.attention_backend = groups, device, attention_backend
        self.float64_loss, self.pad_multiple = float64_loss, pad_multiple
        self.flops_fn, self.batch_sizes = flops_fn, batch_sizes
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        self._iteration = 0
        self.sampler = PlannedBatches(sampler, source.lengths, batch_scheduler, ahead=plan_ahead)
        self._measured: Optional[tuple[Plan, float]] = None  # last plan, its compute seconds

    @property
    def iteration(self) -> int:
        """Iterations done; setting it (resume) moves the LR schedule along."""
        return self._iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._iteration = int(value)
        self.scheduler.num_steps = 0
        # One step per iteration, or per sample under a batch-size schedule (Megatron-LM).
        self.scheduler.step(increment=self._iteration if self.batch_sizes is None
                            else self.batch_sizes.consumed_before(self._iteration))

    def next_plan(self) -> tuple[np.ndarray, Plan]:
        """Draws the next global batch and plans it: ``(dataset ids [K], plan)``."""
        return self.sampler.take()

    def _micro_batches(self, batch_ids: np.ndarray, plan: Plan, source: SampleSource):
        """This rank's micro-batches, materialised lazily (at least one, maybe empty)."""
        mbs = plan.dp_ranks[self.groups.dp_rank]
        for mb in mbs:
            yield materialize(source, batch_ids, plan, mb, self.groups, self.device,
                              self.attention_backend)
        if not mbs:
            yield None

    def compute_gradients(self, batch_ids: np.ndarray, plan: Plan) -> float:
        """Forward/backward of this rank's micro-batches through mcore's schedule.

        Leaves the DP x CP reduced gradient of the global-batch loss in the DDP buffers
        (``param.main_grad``).

        Returns:
            The global-batch loss (mean over its loss tokens).
        """
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = self.loss_sums(batch_ids, plan, forward_only=False)
        return float(total[0] / total[1].clamp(min=1))

    def loss_sums(self, batch_ids: np.ndarray, plan: Plan, *, forward_only: bool,
                  source: Optional[SampleSource] = None) -> torch.Tensor:
        """Runs this rank's micro-batches through mcore's schedule (``forward_only``: no
        backward, as validation does, on ``source``; default the training source).

        Returns:
            float64 ``[2]`` on the training device: the global batch's summed token losses
            and its loss tokens, reduced over DP x CP (and the pipeline): the same on every
            rank.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if plan.dp_size <= self.groups.dp_rank or plan.cp_size != self.groups.cp_size:
            raise ValueError(f"plan is for DP {plan.dp_size} x CP {plan.cp_size}, this rank is "
                             f"DP rank {self.groups.dp_rank} of a CP-{self.groups.cp_size} group")
        num = max(1, len(plan.dp_ranks[self.groups.dp_rank]))
        source = self.source if source is None else source
        data = self._micro_batches(batch_ids, plan, source)
        p2p = contextlib.nullcontext()
        if self.groups.pp_size > 1:  # every stage and CP rank feeds the same list
            from megatron.skrull.pipeline import pipeline_micro_batches

            data = pipeline_micro_batches(source, batch_ids, plan, self.groups,
                                          self.device, self.attention_backend)
            num, data, p2p = len(data), iter(data), cpu_pipeline_p2p(self.device)
        step = functools.partial(forward_step, float64_loss=self.float64_loss,
                                 pad_multiple=self.pad_multiple)
        with cuda_to_cpu(self.device), p2p:
            reports = get_forward_backward_func()(
                forward_step_func=step, data_iterator=data,
                model=[self.model], num_microbatches=num, seq_length=plan.bucket_size,
                micro_batch_size=1, forward_only=forward_only)
        # Off the last pipeline stage there are no losses: zeros, summed along the pipeline.
        total = (torch.stack([r["lm loss"] for r in reports]).sum(0) if reports
                 else torch.zeros(2, dtype=torch.float64, device=self.device))
        if self.groups.grad_group is not None and dist.get_world_size(self.groups.grad_group) > 1:
            dist.all_reduce(total, group=self.groups.grad_group)
        if self.groups.pp_size > 1:
            from megatron.core import parallel_state as ps

            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        return total

    def gradients(self) -> dict[str, torch.Tensor]:
        """Copies of the reduced gradients by parameter name (after ``compute_gradients``)."""
        return {n: p.main_grad.detach().clone() for n, p in self.model.module.named_parameters()}

    def grad_norm(self) -> float:
        """mcore's global (TP-aware) gradient norm of the reduced gradients."""
        with cuda_to_cpu(self.device), foreach_multi_tensor():
            self.optimizer.prepare_grads()
            return float(self.optimizer.get_grad_norm())

    def train_step(self) -> IterationStats:
        """One iteration: plan, gradients, clip, AdamW step, LR schedule."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        batch_ids, plan = self.next_plan()
        planning = self.sampler.exposed_seconds
        # One tiny collective: plans agree on every rank, and the last iteration's time
        # (max over ranks) reaches every rank's online refit, so the refit and the next
        # plan (prefetched only after it) stay identical everywhere.
        last_plan, last_seconds = self._measured or (None, 0.0)
        seconds = agree_on_plan(plan, iteration=self.iteration + 1, device=self.device,
                                measured_seconds=last_seconds)
        if last_plan is not None and hasattr(self.batch_scheduler, "observe"):
            self.batch_scheduler.observe(last_plan, seconds)
        self.sampler.prefetch()
        stats = self.run_plan(batch_ids, plan, start=start)
        self._measured = (plan, stats.seconds - planning)
        return dataclasses.replace(stats, planning_seconds=planning)

    def run_plan(self, batch_ids: np.ndarray, plan: Plan, *,
                 start: Optional[float] = None) -> IterationStats:
        """One iteration of a given global batch and plan: gradients, clip, step, LR.

        Args:
            batch_ids: ``[K]`` dataset ids of the global batch.
            plan: Its plan (the same on every rank).
            start: ``time.perf_counter()`` the iteration's time counts from (default: now).
        """
        if start is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        loss = self.compute_gradients(batch_ids, plan)
        forward_backward = time.perf_counter() - start
        lr = self.optimizer.param_groups[0]["lr"]
        with cuda_to_cpu(self.device), foreach_multi_tensor():
            updated, norm, _ = self.optimizer.step()
        if updated:  # fp16 skips the update (and the schedule) on overflow, as Megatron
            self.scheduler.step(increment=len(batch_ids) if self.batch_sizes else 1)
        self._iteration += 1
        consumed = (self.batch_sizes.consumed_before(self._iteration) if self.batch_sizes
                    else self._iteration * len(batch_ids))  # constant size: exact on resume
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return IterationStats(
            iteration=self.iteration, loss=loss, lr=lr, grad_norm=float(norm or 0.0),
            seconds=time.perf_counter() - start, predicted_seconds=predicted_seconds(plan),
            tokens=int(plan.lengths.sum()), micro_batches=plan.num_micro_batches,
            local_share=plan.local_token_share(), forward_backward_seconds=forward_backward,
            optimizer_seconds=time.perf_counter() - start - forward_backward,
            flops=self.flops_fn(plan.lengths) if self.flops_fn is not None else None,
            global_batch_size=len(batch_ids), consumed_samples=consumed, skipped=not updated,
            loss_scale=_loss_scale(self.optimizer))


def _loss_scale(optimizer) -> float:
    """The fp16 grad scaler's scale, 1.0 without one (bf16 and fp32 never scale, and reading
    mcore's constant would be one more device sync per step: tests/test_host_syncs.py)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if all(getattr(o, "grad_scaler", None) is None for o in parts):
        return 1.0
    return float(optimizer.get_loss_scale())


class MetricsLogger:
    """Prints one line per ``log_interval`` and writes TensorBoard scalars (logging rank).

    The line is Megatron-LM's (timestamp, iteration, consumed samples, elapsed time per
    iteration, learning rate, global batch size, lm loss, loss scale, grad norm, skipped and
    nan iterations; with ``log_throughput`` (``--log-throughput``) its model TFLOP/s per GPU
    over ``world_size`` GPUs), then Skrull's: the cost model's predicted time, tokens/s,
    micro-batches, the share of tokens kept local and the planning the loop waited for.
    """

    def __init__(self, *, log_interval: int, train_iters: int, enabled: bool,
                 tensorboard_dir: Optional[str] = None, printer: Callable[[str], None] = print,
                 log_throughput: bool = False, world_size: int = 1):
        self.log_interval, self.train_iters = log_interval, train_iters
        self.log_throughput, self.world_size = log_throughput, world_size
        self.enabled, self.printer = enabled, printer
        self.window: list[IterationStats] = []
        self.writer = None
        self.log_timers = False  # --log-timers-to-tensorboard (Megatron-LM's timer names)
        # iteration -> [(dataset, samples drawn)] of a blend (None: one dataset)
        self.dataset_counts: Optional[Callable[[int], list[tuple[str, int]]]] = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)

    def record(self, stats: IterationStats) -> None:
        if not self.enabled:
            return
        self.window.append(stats)
        if self.writer is not None:
            it = stats.iteration
            for name, value in (("loss", stats.loss), ("learning-rate", stats.lr),
                                ("grad-norm", stats.grad_norm), ("iteration-time", stats.seconds),
                                ("tokens-per-second", stats.tokens_per_second),
                                ("micro-batches", stats.micro_batches),
                                ("local-token-share", stats.local_share),
                                ("batch-size", stats.global_batch_size),
                                ("predicted-iteration-time", stats.predicted_seconds)):
                if value is not None:
                    self.writer.add_scalar(name, value, it)
            if self.log_timers:
                self.write_timers(stats)
            if self.log_throughput and stats.flops is not None:
                self.writer.add_scalar("throughput", throughput_tflops(
                    stats.flops, stats.seconds, self.world_size), it)
        counts = self.dataset_counts(stats.iteration) if self.dataset_counts else []
        if self.writer is not None:
            for name, count in counts:
                self.writer.add_scalar(f"consumed samples {name}", count, stats.iteration)
        if stats.iteration % self.log_interval == 0 or stats.iteration == self.train_iters:
            self.printer(self.format(self.window) + _dataset_counts(counts))
            self.window = []

    def write_timers(self, stats: IterationStats) -> None:
        """Megatron-LM's ``--log-timers-to-tensorboard`` scalars (seconds per iteration);
        batch-generator is the planning the iteration waited for."""
        for name, value in (("forward-backward", stats.forward_backward_seconds),
                            ("optimizer", stats.optimizer_seconds),
                            ("batch-generator", stats.planning_seconds)):
            self.writer.add_scalar(f"{name}-time", value, stats.iteration)

    def format(self, window: list[IterationStats]) -> str:
        """Megatron-LM's training log line (its fields, labels and order at d98e8a64, so its
        log parsers read it), then Skrull's fields; means over the window (``lm loss`` over
        every iteration: Megatron's leaves out fp16's skipped ones, 0 when all are)."""
        last, n = window[-1], len(window)
        seconds = sum(s.seconds for s in window) / n
        predicted = [s.predicted_seconds for s in window if s.predicted_seconds is not None]
        pred = f"{1e3 * sum(predicted) / len(predicted):.1f}" if predicted else "n/a"
        tokens = sum(s.tokens for s in window) / sum(s.seconds for s in window)
        nans = sum(not math.isfinite(s.loss) for s in window)
        return (f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
                f" iteration {last.iteration:8d}/{self.train_iters:8d} |"
                f" consumed samples: {last.consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {1e3 * seconds:.1f} |"
                f"{self._throughput(window)}"
                f" learning rate: {last.lr:.6E} |"
                f" global batch size: {last.global_batch_size:5d} |"
                f" lm loss: {sum(s.loss for s in window) / n:.6E} |"
                f" loss scale: {last.loss_scale:.1f} |"
                f" grad norm: {last.grad_norm:.3f} |"
                f" number of skipped iterations: {sum(s.skipped for s in window):3d} |"
                f" number of nan iterations: {nans:3d} |"
                f" predicted (ms): {pred} | tokens/s: {tokens:.0f} |"
                f" micro-batches: {sum(s.micro_batches for s in window) / n:.1f} |"
                f" local tokens: {100 * sum(s.local_share for s in window) / n:.1f}% |"
                f" planning exposed (ms): "
                f"{1e3 * sum(s.planning_seconds for s in window) / n:.1f} |")

    def _throughput(self, window: list[IterationStats]) -> str:
        """Megatron's ``throughput per GPU (TFLOP/s/GPU)`` field over the window, or ``""``."""
        if not self.log_throughput or any(s.flops is None for s in window):
            return ""
        tflops = throughput_tflops(sum(s.flops for s in window),
                                   sum(s.seconds for s in window), self.world_size)
        return f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _dataset_counts(counts: list[tuple[str, int]]) -> str:
    """`` consumed samples per dataset: a 30 (25.0%), b 90 (75.0%) |`` of a blend ('' otherwise)."""
    total = sum(c for _, c in counts)
    if not total:
        return ""
    return " consumed samples per dataset: " + ", ".join(
        f"{name} {c} ({100 * c / total:.1f}%)" for name, c in counts) + " |"


def _batch_size_changes(trainer: Trainer, train_iters: int) -> bool:
    """Whether the next iteration's global batch size differs from the last one's: Megatron-LM
    then saves a checkpoint (``--save``) before training it."""
    sizes, done = getattr(trainer, "batch_sizes", None), trainer.iteration
    return sizes is not None and 0 < done < train_iters and sizes.size(done) != sizes.size(done - 1)


def train(trainer: Trainer, *, train_iters: int, metrics: Optional[MetricsLogger] = None,
          save_interval: Optional[int] = None,
          save_fn: Optional[Callable[[Trainer], None]] = None,
          exit_fn: Optional[Callable[[Trainer], bool]] = None,
          exit_interval: Optional[int] = None, evaluator=None) -> list[IterationStats]:
    """Runs iterations ``trainer.iteration + 1 .. train_iters``.

    Args:
        train_iters: Last iteration to run (a resumed trainer continues from its iteration).
        metrics: Logger (``None``: silent).
        save_interval: Save every this many iterations (and after the last) via ``save_fn``;
            under a batch-size schedule also before each change of the global batch size.
        save_fn: ``save_fn(trainer)`` writes a checkpoint.
        exit_fn: Asked after every iteration (same answer on every rank); True saves
            (``save_fn``) and stops early (``--exit-signal-handler``).
        exit_interval: Save and stop after an iteration divisible by it (``--exit-interval``).
        evaluator: :class:`megatron.skrull.evaluation.Evaluator` (``--eval-interval``, and
            after the last iteration unless the run stopped early, as Megatron).

    Returns:
        The stats of every iteration run.
    """
    history = []
    while trainer.iteration < train_iters:
        stats = trainer.train_step()
        history.append(stats)
        if metrics is not None:
            metrics.record(stats)
        if evaluator is not None:
            evaluator.after_iteration(trainer)
        if save_fn is not None and save_interval and trainer.iteration % save_interval == 0:
            save_fn(trainer)
        if (exit_fn is not None and exit_fn(trainer)) or (
                exit_interval and trainer.iteration % exit_interval == 0):
            evaluator = None  # stopped early: no closing validation (Megatron exits too)
            break
        if save_fn is not None and _batch_size_changes(trainer, train_iters):
            save_fn(trainer)
    trainer.sampler.cancel()  # a batch drawn ahead is not consumed: rewind the sampler
    if save_fn is not None and history and not (save_interval and
                                                trainer.iteration % save_interval == 0):
        save_fn(trainer)
    if evaluator is not None:
        evaluator.after_training(trainer)
    return history
