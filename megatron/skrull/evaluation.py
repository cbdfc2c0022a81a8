"""Validation in the training loop: Megatron's ``--eval-interval`` and ``--eval-iters``.

Every ``--eval-interval`` iterations, and once after the last one (as Megatron's
``pretrain`` does unless the run stopped early), :class:`Evaluator` runs ``--eval-iters``
validation global batches forward-only through the same path as training
(:meth:`megatron.skrull.training.Trainer.loss_sums`: mcore's ``get_forward_backward_func``
with ``forward_only=True``, the batch scheduler's plans, DACP attention over the CP ring,
the pipeline when PP > 1) and logs, on rank 0, Megatron's line::

     validation loss at iteration 20 | lm loss value: 2.341200E+00 | lm loss PPL: 1.039200E+01 |

The value is token-weighted: the summed token losses of all K batches over their loss
tokens, each batch's sums reduced over DP x CP (and the pipeline) exactly as the training
loss is.

Which batches: the first ``K`` global batches of a :class:`~megatron.skrull.data.
GlobalBatchSampler` over the validation set (seeded by ``--seed``), planned once at start-up,
and the SAME K batches at every evaluation.  Megatron instead advances its validation
iterator (each evaluation reads the next ``K x global batch`` samples, wrapping around the
set), so its successive values mix a model change with a data change; fixed batches make
the curve comparable point to point and keep a resumed run's values identical to the
uninterrupted run's without any saved validation state.

Evaluation never changes training: the model runs in eval mode under ``torch.no_grad``
(nothing reaches the gradient buffers or the optimizer), the torch and mcore RNG states are
restored afterwards, the training sampler and its drawn-ahead plan are untouched, and the
model is back in train mode.  With ``--overlap-param-gather`` the parameters are
all-gathered first (mcore's forward pre-hooks are off during evaluation, as in Megatron).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from megatron.skrull.cpu_compat import cuda_to_cpu
from megatron.skrull.data import GlobalBatchSampler, SampleSources
from megatron.skrull.plan_ahead import agree_on_plan

PPL_CAP = 20.0  # Megatron reports exp(min(20, loss)) so a diverged loss prints a number


def validation_line(iteration: int, loss: float, *, suffix: str = "", name: str = "") -> str:
    """Megatron's ``evaluate_and_print_results`` line (value and perplexity); ``name``: one
    of several validation sets (Megatron's ``validation-<name>``)."""
    ppl = math.exp(min(PPL_CAP, loss))
    label = f"validation-{name}" if name else "validation"
    return (f" {label} loss at iteration {iteration}{suffix} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} |")


@contextlib.contextmanager
def evaluation_mode(trainer) -> Iterator[None]:
    """Eval mode, no autograd, RNG and train mode restored, parameters gathered first."""
    from megatron.skrull.checkpointing import _rng_state, _set_rng_state

    model, rng = trainer.model, _rng_state()
    hooks = bool(getattr(model, "use_forward_hook", False))  # --overlap-param-gather
    if hooks:  # as Megatron: gather what the last step updated at once, and keep the
        # per-bucket gather hooks out of the forward-only passes
        with cuda_to_cpu(trainer.device):
            model.disable_forward_pre_hook(param_sync=True)
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()
        if hooks:
            model.enable_forward_pre_hook()
        _set_rng_state(rng)


class Evaluator:
    """The validation batches of a run and when to run them.

    Args:
        source: The validation :class:`~megatron.skrull.samples.SampleSource`.
        origin: Where it comes from (``--split ...`` / ``--valid-data-path ...``).
        batches: ``[(dataset ids [G], plan)]``, the K validation global batches.
        eval_interval: Evaluate after every iteration divisible by it (``None``: only at
            the end).
        printer: Rank 0's line printer (``None``: silent rank).
        writer: TensorBoard ``SummaryWriter`` (rank 0) or ``None``.

    ``log_ppl`` (``--log-validation-ppl-to-tensorboard``) also writes the perplexity.
    """

    log_ppl: bool = False

    def __init__(self, *, source: Any, batches: list, eval_interval: Optional[int],
                 origin: str = "", printer: Optional[Callable[[str], None]] = None,
                 writer: Any = None, name: str = ""):
        self.source, self.batches, self.eval_interval = source, batches, eval_interval
        self.origin, self.name = origin, name
        self.printer, self.writer = printer, writer
        self.history: list[tuple[int, float]] = []  # (iteration, loss) of every evaluation

    def loss(self, trainer) -> float:
        """The validation loss of ``trainer``'s current model (collective over the world)."""
        total = torch.zeros(2, dtype=torch.float64)
        with evaluation_mode(trainer):
            for ids, plan in self.batches:
                total += trainer.loss_sums(ids, plan, forward_only=True,
                                           source=self.source).cpu()
        return float(total[0] / total[1].clamp(min=1))

    def evaluate(self, trainer, *, suffix: str = "") -> float:
        """Runs the K batches now, logs Megatron's line (rank 0), returns the loss."""
        if self.history and self.history[-1][0] == trainer.iteration:
            loss = self.history[-1][1]  # same model as the evaluation just done
        else:
            loss = self.loss(trainer)
            self.history.append((trainer.iteration, loss))
            if self.writer is not None:
                tag = f"lm loss validation{'-' + self.name if self.name else ''}"
                self.writer.add_scalar(tag, loss, trainer.iteration)
                if self.log_ppl:  # --log-validation-ppl-to-tensorboard, as Megatron-LM
                    self.writer.add_scalar(f"{tag} ppl", math.exp(min(PPL_CAP, loss)),
                                           trainer.iteration)
        if self.printer is not None:
            line = validation_line(trainer.iteration, loss, suffix=suffix, name=self.name)
            self.printer("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        return loss

    def after_iteration(self, trainer) -> None:
        """Evaluates when the iteration is a multiple of ``--eval-interval``."""
        if self.eval_interval and trainer.iteration % self.eval_interval == 0:
            self.evaluate(trainer)

    def after_training(self, trainer) -> None:
        """Megatron's closing evaluation (``... on validation set``)."""
        self.evaluate(trainer, suffix=" on validation set")


def validation_batches(source: Any, batch_scheduler: Callable, *, iters: int,
                       global_batch_size: int, seed: int,
                       device: Optional[torch.device] = None) -> list:
    """The first ``iters`` global batches over ``source`` and their plans.

    Plans come from the run's batch scheduler (the seed cost model: planning here, once,
    keeps the online refit and the plan-ahead worker out of it); each plan is checked to
    be the same on every rank (one small all-reduce per batch, at start-up).
    """
    sampler = GlobalBatchSampler(len(source), global_batch_size, seed)
    batches = []
    for i in range(iters):
        ids = np.asarray(next(sampler), dtype=np.int64)
        plan = batch_scheduler(source.lengths[ids])
        agree_on_plan(plan, iteration=-(i + 1), device=device or torch.device("cpu"))
        batches.append((ids, plan))
    return batches


def build_evaluator(cfg, sources: SampleSources, batch_scheduler: Callable, *,
                    device: Optional[torch.device] = None, name: str = ""):
    """The run's :class:`Evaluator`, or ``None`` when it does not validate.

    Raises:
        ValueError: Validation asked for without a usable validation set (the message
            names the flag to change).
    """
    if sources.valid_sets:  # a blend: one loss per dataset
        group = [build_evaluator(cfg, SampleSources(None, valid, origin), batch_scheduler,
                                 device=device, name=name)
                 for name, valid, origin in sources.valid_sets]
        return EvaluatorGroup([ev for ev in group if ev is not None]) if any(group) else None
    v, valid, gbs = cfg.validation, sources.valid, cfg.global_batch_size
    if valid is None or len(valid) == 0:
        if v.requested and v.iters > 0:
            where = (f"the {sources.valid_origin} is empty" if valid is not None
                     else "there is no validation set")
            raise ValueError(
                f"--eval-interval/--eval-iters ask for validation but {where}; give "
                "--split with a validation weight (e.g. --split 969,30,1) or "
                "--valid-data-path PREFIX, or use --eval-iters 0")
        return None
    if v.iters == 0:
        return None
    if len(valid) < gbs:
        raise ValueError(
            f"the validation set ({sources.valid_origin}) has {len(valid)} samples, fewer "
            f"than one --global-batch-size {gbs}; give it more samples (a larger validation "
            "weight in --split or a larger --valid-data-path) or use --eval-iters 0")
    batches = validation_batches(valid, batch_scheduler, iters=v.iters, global_batch_size=gbs,
                                 seed=cfg.optim.seed, device=device)
    return Evaluator(source=valid, batches=batches, eval_interval=v.eval_interval,
                     origin=sources.valid_origin, name=name)


class EvaluatorGroup:
    """Several validation sets, one :class:`Evaluator` (and one loss line) each."""

    def __init__(self, evaluators: list[Evaluator]):
        self.evaluators = evaluators

    def evaluate(self, trainer, *, suffix: str = "") -> list[float]:
        return [ev.evaluate(trainer, suffix=suffix) for ev in self.evaluators]

    def after_iteration(self, trainer) -> None:
        for ev in self.evaluators:
            ev.after_iteration(trainer)

    def after_training(self, trainer) -> None:
        for ev in self.evaluators:
            ev.after_training(trainer)


def describe(evaluator: Evaluator) -> str:
    """Rank 0's start-up line about the validation set (a line per set of a group)."""
    if isinstance(evaluator, EvaluatorGroup):
        return "\n".join(describe(ev).replace(" validation on", f" validation-{ev.name} on")
                         for ev in evaluator.evaluators)
    distinct = len({int(i) for ids, _ in evaluator.batches for i in ids})
    when = (f"every {evaluator.eval_interval} iterations and " if evaluator.eval_interval
            else "")
    return (f" skrull: validation on the {evaluator.origin}: {len(evaluator.source)} samples; "
            f"{when}after "
            f"the last iteration, the same {len(evaluator.batches)} global "
            f"batch{'es' if len(evaluator.batches) > 1 else ''} "
            f"({distinct} distinct samples) each time")


def attach(evaluator: Optional[Evaluator], metrics) -> Optional[Evaluator]:
    """Gives ``evaluator`` the logging rank's printer and TensorBoard writer."""
    if evaluator is not None and metrics is not None and metrics.enabled:
        for ev in getattr(evaluator, "evaluators", [evaluator]):
            ev.printer, ev.writer = metrics.printer, metrics.writer
    return evaluator
