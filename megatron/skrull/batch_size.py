"""Megatron's global-batch-size schedules: ``--step-batch-size-schedule`` and the deprecated
``--rampup-batch-size START INCR SAMPLES``.

Megatron-LM sets each iteration's global batch size from the samples consumed before it
(``consumed_train_samples``): the iteration trains that many samples, the consumed count
grows by it, and the LR schedule -- counted in samples whenever a schedule is on -- steps by
it.  Here the sampler hands out a global batch of that size (``batch_size_samplers.py``), the
Skrull scheduler plans whatever ``K`` it gets, and the checkpoint's consumed samples and LR
state let a resume continue the ramp exactly.

Sources (Megatron-LM d98e8a64ddf3 unless named):

* ``--step-batch-size-schedule "THRESHOLD:BS ..."``: ``StepBatchsizeNumMicroBatchesCalculator``
  of ``megatron/core/num_microbatches_calculator.py``.  mcore 0.16.1 (installed) lacks it, so
  its parser and lookup are re-implemented here (:func:`parse_step_schedule`,
  :func:`step_batch_size`): K/M/B/T suffixes, thresholds in tokens divided by
  ``--seq-length`` (training always passes it), sorted, first 0, strictly increasing.
* ``--rampup-batch-size``: mcore 0.16.1's ``RampupBatchsizeNumMicroBatchesCalculator``, used
  as is, with the flag rules of Megatron-LM before 532ad926b4 (``--train-samples`` required).
* ``--train-samples`` -> iterations and the LR schedule in samples: ``update_train_iters``
  and ``get_optimizer_param_scheduler`` of ``megatron/training/training.py``.

Differences from Megatron-LM, all deliberate:

* no divisibility of the global batch by ``--micro-batch-size`` x DP is needed (the
  scheduler packs any ``K``), so ``--decrease-batch-size-if-needed`` has nothing to do;
* d98e8a64 refuses ``--global-batch-size`` with ``--step-batch-size-schedule``, yet its own
  ``train_gpt3_175b_distributed.sh`` passes both (1536, the schedule's last size): accepted
  here when it equals the schedule's last size;
* iteration-based LR steps with a step schedule count ``iterations x`` the schedule's last
  size (d98e8a64 multiplies by ``args.global_batch_size``, which it leaves at
  ``--micro-batch-size`` x DP when the schedule is given);
* d98e8a64 ignores ``--rampup-batch-size`` (a deprecation warning); here it ramps as its
  help text and mcore 0.16.1 say;
* a decreasing step schedule is refused up front (Megatron-LM stops when it is reached);
* a resume keeps the schedule (Megatron-LM allows a new one): the data order depends on it.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Any, Callable, Optional

STEP_FLAG, RAMPUP_FLAG = "--step-batch-size-schedule", "--rampup-batch-size"
_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def parse_count(text: str) -> int:
    """``"2.4B"`` -> 2400000000: a number with an optional K/M/B/T suffix, as Megatron-LM
    parses it (``int(float(number) * multiplier)``)."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    if multiplier != 1:
        text = text[:-1]
    return int(float(text) * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """``--step-batch-size-schedule`` -> ``((threshold in samples, batch size), ...)``.

    Entries are ``THRESHOLD:BS`` separated by spaces or commas; thresholds are tokens,
    converted to samples by ``// seq_length``; sorted by threshold.

    Raises:
        ValueError: Megatron-LM's messages (bad entry, first threshold not 0, thresholds
            not strictly increasing, a batch size < 1).
    """
    schedule = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f'Invalid schedule entry "{entry}". Expected format: '
                             '"THRESHOLD:BATCH_SIZE"')
        threshold, size = entry.split(":", 1)
        try:
            schedule.append((parse_count(threshold) // seq_length, parse_count(size)))
        except ValueError:
            raise ValueError(f'Invalid schedule entry "{entry}": THRESHOLD and BATCH_SIZE are '
                             "numbers with an optional K/M/B/T suffix") from None
    schedule.sort(key=lambda entry: entry[0])
    if not schedule:
        raise ValueError("schedule must have at least one entry")
    if schedule[0][0] != 0:
        raise ValueError(f"first schedule entry must have threshold 0, got {schedule[0][0]}")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"schedule thresholds must be strictly increasing, got {before} "
                             f"before {after} (in samples: tokens // --seq-length {seq_length})")
    for _, size in schedule:
        if size <= 0:
            raise ValueError(f"batch size must be positive, got {size}")
    return tuple(schedule)


def step_batch_size(schedule: tuple[tuple[int, int], ...], consumed_samples: int) -> int:
    """The batch size of the last entry whose threshold ``consumed_samples`` reached."""
    thresholds = [t for t, _ in schedule]
    return schedule[max(0, bisect.bisect_right(thresholds, consumed_samples) - 1)][1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSizeArgs:
    """A global-batch-size schedule and its LR steps in samples (part of ``RunConfig.run``).

    Attributes:
        step_batch_size_schedule: The flag's text (or ``None``).
        rampup_batch_size: ``(start, increment, ramp samples)`` (or ``None``).
        global_batch_size: The size once the schedule has settled (``--global-batch-size``
            after a ramp; the last entry of a step schedule).
        seq_length: Tokens per sample of the step schedule's thresholds.
        lr_warmup_samples / lr_decay_samples / wd_incr_samples: Megatron-LM's
            ``OptimizerParamScheduler`` steps, in samples.
    """

    step_batch_size_schedule: Optional[str] = None
    rampup_batch_size: Optional[tuple[int, int, int]] = None
    global_batch_size: int
    seq_length: int
    lr_warmup_samples: float = 0.0
    lr_decay_samples: float = 0.0
    wd_incr_samples: float = 0.0

    @property
    def spec(self) -> str:
        """The flag as given: what a checkpoint records and a resume must repeat."""
        if self.step_batch_size_schedule is not None:
            return f'{STEP_FLAG} "{self.step_batch_size_schedule}"'
        return f"{RAMPUP_FLAG} {' '.join(map(str, self.rampup_batch_size))}"

    @property
    def settled_samples(self) -> int:
        """Consumed samples from which the size stays :attr:`global_batch_size`."""
        if self.step_batch_size_schedule is not None:
            return self.schedule()[-1][0]
        return self.rampup_batch_size[2] + 1  # mcore: the ramp ends when consumed > samples

    @property
    def max_batch_size(self) -> int:
        if self.step_batch_size_schedule is not None:
            return max(size for _, size in self.schedule())
        return self.global_batch_size

    def schedule(self) -> tuple[tuple[int, int], ...]:
        return parse_step_schedule(self.step_batch_size_schedule, self.seq_length)

    def size_function(self) -> Callable[[int], int]:
        """``consumed samples -> global batch size`` (mcore's calculator for a ramp)."""
        if self.step_batch_size_schedule is not None:
            return functools.partial(step_batch_size, self.schedule())
        return _rampup_sizes(self.rampup_batch_size, self.global_batch_size)


def _rampup_sizes(rampup: tuple[int, int, int], global_batch_size: int) -> Callable[[int], int]:
    """mcore 0.16.1's linear ramp; micro-batch x DP = 1: the scheduler packs any size."""
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator)

    start, increment, samples = rampup
    calculator = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, 1, 1, False, 0, start, increment, samples)

    def size(consumed_samples: int) -> int:
        calculator.update(consumed_samples, consistency_check=False)
        return calculator.get_current_global_batch_size()

    return size


def megatron_train_iters(args: BatchSizeArgs, train_samples: int) -> int:
    """Iterations of ``--train-samples`` under the schedule, as Megatron-LM counts them.

    Step schedule (d98e8a64): until the consumed samples reach ``train_samples`` (the last
    batch may overshoot).  Ramp (before 532ad926b4): the ramp's iterations while consumed <=
    ramp samples, then whole batches of the final size (a partial last batch is dropped).
    """
    size, consumed, iterations = args.size_function(), 0, 0
    if args.rampup_batch_size is None:
        while consumed < train_samples:
            consumed += size(consumed)
            iterations += 1
        return iterations
    ramp_samples = args.rampup_batch_size[2]
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += size(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // args.global_batch_size
    return iterations


class GlobalBatchSizes:
    """Iteration -> global batch size and samples consumed before it, for one run.

    Walks the schedule from iteration 0 (cached) until the size has settled, then counts
    whole batches of the final size; every rank computes the same numbers.

    Args:
        args: The run's :class:`BatchSizeArgs`.
    """

    def __init__(self, args: BatchSizeArgs):
        self.args, self.final = args, args.global_batch_size
        self.max_size = args.max_batch_size
        self._size_at = args.size_function()
        self._settled = args.settled_samples
        self._consumed = [0]  # samples consumed before iteration i, while the size changes

    def _walk(self, iteration: int) -> None:
        while len(self._consumed) <= iteration and self._consumed[-1] < self._settled:
            self._consumed.append(self._consumed[-1] + self._size_at(self._consumed[-1]))

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed by iterations ``0 .. iteration - 1`` (0-based)."""
        self._walk(iteration)
        if iteration < len(self._consumed):
            return self._consumed[iteration]
        last = len(self._consumed) - 1
        return self._consumed[last] + (iteration - last) * self.final

    def size(self, iteration: int) -> int:
        """Global batch size of 0-based ``iteration``."""
        return self.consumed_before(iteration + 1) - self.consumed_before(iteration)

    def settled_iteration(self, iteration: int) -> Optional[int]:
        """An iteration <= ``iteration`` from which every size is the final one, else
        ``None`` (the first such one the walk reaches: the same on every call)."""
        self._walk(iteration)
        last = len(self._consumed) - 1
        return last if self._consumed[last] >= self._settled and last <= iteration else None


def check_schedule(state: dict, spec: Optional[str]) -> None:
    """Refuses a sampler state saved under another schedule (``spec``: the run's
    :attr:`BatchSizeArgs.spec`, ``None``: a constant global batch size): the data order
    and the LR steps would change."""
    saved = state.get("batch_size_schedule")
    if saved != spec:
        was = saved or f"a constant --global-batch-size {state.get('global_batch_size')}"
        raise ValueError(f"the checkpoint's data position was saved with {was}, this run has "
                         f"{spec or 'a constant --global-batch-size'}; resume with the "
                         "batch-size flags it was saved with")


# ---- flags -> BatchSizeArgs (parsing must not import megatron.core: a ramp does, lazily)


def _decrease_given(ns: Any) -> bool:
    from megatron.skrull.megatron_args import dest

    return bool(getattr(ns, dest("--decrease-batch-size-if-needed"), False))


def _step_problems(ns: Any, schedule, problems: list) -> None:
    last = schedule[-1][1]
    if ns.global_batch_size is not None and ns.global_batch_size != last:
        problems.append(f"Cannot specify both {STEP_FLAG} and --global-batch-size (Megatron-LM's "
                        f"rule; accepted here only as the schedule's last size {last}): drop "
                        f"--global-batch-size {ns.global_batch_size}")
    if _decrease_given(ns):
        problems.append(f"Cannot specify both {STEP_FLAG} and --decrease-batch-size-if-needed: "
                        "drop --decrease-batch-size-if-needed")
    for (_, before), (_, after) in zip(schedule, schedule[1:]):
        if after < before:
            problems.append(f"{STEP_FLAG}: batch size {after} after {before}; Megatron-LM stops "
                            "when the number of microbatches decreases: make the sizes "
                            "non-decreasing")
            break


def _rampup_problems(ns: Any, problems: list) -> None:
    start, increment, samples = ns.rampup_batch_size
    gbs, fix = ns.global_batch_size, f"fix {RAMPUP_FLAG} START INCR SAMPLES"
    checks = ((start > 0, f"start batch size should be positive, got {start}"),
              (increment > 0, f"batch size increment should be positive, got {increment}"),
              (samples >= 0, f"ramp-up samples should be non-negative, got {samples}"))
    problems.extend(f"{RAMPUP_FLAG}: {msg}; {fix}" for ok, msg in checks if not ok)
    if samples == 0:  # (mcore would divide by zero)
        problems.append(f"{RAMPUP_FLAG}: ramp-up samples 0: nothing to ramp; drop the flag")
    if gbs is None:
        problems.append(f"{RAMPUP_FLAG} needs --global-batch-size (the size after the ramp)")
    elif start > 0 and increment > 0:
        if gbs < start:
            problems.append(f"{RAMPUP_FLAG}: expected global batch size to be greater than or "
                            f"equal to start batch size, got {gbs} and {start}; {fix}")
        elif gbs == start:
            problems.append(f"{RAMPUP_FLAG} starts at --global-batch-size {gbs}: nothing to "
                            "ramp; drop the flag")
        elif (gbs - start) % increment:
            problems.append(f"{RAMPUP_FLAG}: expected global batch size interval "
                            f"({gbs - start}) to be divisible by global batch size increment "
                            f"({increment}); {fix}")
    if ns.train_iters is not None:
        problems.append(f"{RAMPUP_FLAG}: expected no batch-size rampup for iteration-based "
                        f"training (Megatron-LM's rule): give --train-samples instead of "
                        f"--train-iters, or use {STEP_FLAG}, which runs with --train-iters")


def _lr_fields(ns: Any, args: BatchSizeArgs) -> tuple[BatchSizeArgs, dict]:
    """Megatron-LM's LR steps in samples, and ``OptimArgs``' iteration fields (those of
    ``--train-samples`` in iterations of the final size, as without a schedule)."""
    final, fraction = args.global_batch_size, ns.lr_warmup_fraction
    if ns.train_samples is not None:
        iters, wd = megatron_train_iters(args, ns.train_samples), ns.train_samples
        decay = ns.lr_decay_samples if ns.lr_decay_samples is not None else ns.train_samples
        warmup = ns.lr_warmup_samples or 0
        fields = {"lr_decay_iters": decay / final, "lr_warmup_iters": warmup / final}
    else:
        iters, wd = ns.train_iters, ns.train_iters * final
        decay, warmup = (ns.lr_decay_iters or iters) * final, ns.lr_warmup_iters * final
        fields = {"lr_decay_iters": ns.lr_decay_iters, "lr_warmup_iters": ns.lr_warmup_iters}
    if fraction is not None:
        warmup = fraction * decay
    args = dataclasses.replace(args, lr_warmup_samples=warmup, lr_decay_samples=decay,
                               wd_incr_samples=wd)
    return args, {"train_iters": iters, **fields}


def describe(args: BatchSizeArgs) -> str:
    """Rank 0's start-up line about the schedule."""
    if args.step_batch_size_schedule is not None:
        steps = ", ".join(f"{size} from {threshold}" for threshold, size in args.schedule())
        return (f'{args.spec}: global batch size by consumed samples: {steps} (thresholds in '
                f"tokens // --seq-length {args.seq_length}); the LR schedule counts samples")
    start, increment, samples = args.rampup_batch_size
    return (f"{args.spec}: global batch size {start} rising by {increment} to "
            f"{args.global_batch_size} over {samples} samples (mcore's ramp); the LR schedule "
            f"counts samples. Deprecated in Megatron-LM, whose current version ignores it: "
            f"{STEP_FLAG} replaces it")


def _schedule_args(ns: Any, problems: list) -> Optional[BatchSizeArgs]:
    """The flags' schedule, or ``None`` after appending its problems."""
    step, rampup, found = ns.step_batch_size_schedule, ns.rampup_batch_size, len(problems)
    if step is not None and rampup is not None:
        problems.append(f"{RAMPUP_FLAG} and {STEP_FLAG}: give one ({RAMPUP_FLAG} is "
                        "Megatron-LM's deprecated form)")
        return None
    if step is not None:
        try:
            schedule = parse_step_schedule(step, ns.seq_length)
        except ValueError as exc:
            problems.append(f"{STEP_FLAG}: {exc}; fix the schedule (thresholds in tokens)")
            return None
        _step_problems(ns, schedule, problems)
        final = schedule[-1][1]
    else:
        _rampup_problems(ns, problems)
        final = ns.global_batch_size
    if len(problems) > found:
        return None
    return BatchSizeArgs(step_batch_size_schedule=step, global_batch_size=final,
                         rampup_batch_size=tuple(rampup) if rampup else None,
                         seq_length=ns.seq_length)


def from_namespace(ns: Any, problems: list, notes: list
                   ) -> tuple[Optional[BatchSizeArgs], int, dict]:
    """``(schedule, global batch size, OptimArgs fields)`` of the parsed flags.

    Without a schedule: ``(None, --global-batch-size, {})``.  With one, the fields replace
    the iteration schedule's (``train_iters`` counted as Megatron-LM does).  Problems are
    appended (the returned values then only keep the configuration buildable).
    """
    if ns.step_batch_size_schedule is None and ns.rampup_batch_size is None:
        if ns.global_batch_size is None:
            problems.append("give --global-batch-size N (sequences per iteration) or a "
                            f"{STEP_FLAG}")
        return None, ns.global_batch_size or 1, {}
    args = _schedule_args(ns, problems)
    if args is None or (ns.train_iters is None) == (ns.train_samples is None):
        return None, (args.global_batch_size if args else 1), {}  # (the second: run_args')
    args, fields = _lr_fields(ns, args)
    if fields["train_iters"] < 1:
        problems.append(f"--train-samples {ns.train_samples}: nothing to train")
    notes.append(describe(args))
    return args, args.global_batch_size, fields
