"""``--skrull-lookahead N``: the training sampler's global batches, a window of N at a time.

:class:`LookaheadSampler` is a thin layer over whatever yields the global batches of
sample ids (:class:`megatron.skrull.data.GlobalBatchSampler`, or any sampler with the same
protocol: ``next()``, an ``iteration`` attribute naming the next iteration it yields,
``state_dict()`` / ``load_state_dict()`` honouring an ``"iteration"`` key, and optionally
``batches_per_epoch``).  It draws a window's N batches one window early and hands them
to :class:`skrull_ext.scheduler.lookahead.WindowPlanner`, which regroups them and judges
both versions with the scheduler; the ``2 N`` judge calls are spread over the previous
window's iterations (about 2 per iteration), and at the window's first iteration the
planner's verdict (regrouped or as drawn) is yielded one batch per iteration.

* **Once per epoch**: windows never cross an epoch boundary and a window's batches are a
  permutation of its drawn samples, so every sample trains exactly once per epoch; every
  batch keeps ``--global-batch-size`` samples, so consumed samples and the LR schedule
  are unchanged.
* **Identical on every rank**: the window is a pure function of its drawn sample ids,
  their lengths and the judge, which prices with the run's *seed* cost model (never the
  ``--skrull-online-cost-model`` refit, whose state differs after a resume).
* **Resumable**: the checkpoint holds the drawn sampler's state before the next batch
  (what N = 1 saves) plus ``skrull_lookahead: N``; a resume mid-window seeks the sampler
  to the window's first iteration, recomputes the window and skips the batches already
  trained.  A state saved with another N is a ``ValueError`` naming the fix (the
  checkpoint loader reports it as one error line).
* **Opt-in**: with N = 1 every call goes straight to the wrapped sampler and the state is
  exactly its own (no extra key), so runs and checkpoints are bit-identical to before.

Where the planning runs: :class:`megatron.skrull.plan_ahead.PlannedBatches` draws the
next batch on its worker thread, so the judge calls run while an iteration trains; only
the first window (and the window a resume lands in) is judged at once.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from skrull_ext.scheduler.lookahead import (Judge, WindowPlan, WindowPlanner, scheduler_judge,
                                            window_span)

STATE_KEY = "skrull_lookahead"


class _Drawn(NamedTuple):
    """A drawn window: the sampler's state before each batch, its planner."""

    states: list
    planner: WindowPlanner


class LookaheadSampler:
    """Global batches of ``sampler``, planned ``lookahead`` at a time.

    Args:
        sampler: The drawn global batches (see the module docstring for its protocol).
        lengths: ``[num_samples]`` lengths indexed by sample id.
        lookahead: ``N`` (``--skrull-lookahead``, >= 1).
        judge: Predicted seconds of one global batch from its lengths (unused at N = 1).
    """

    def __init__(self, sampler: Any, lengths: np.ndarray, lookahead: int,
                 judge: Optional[Judge] = None):
        if lookahead < 1 or (lookahead > 1 and judge is None):
            raise ValueError(f"--skrull-lookahead {lookahead}: use an integer >= 1 "
                             "(N > 1 needs the batch scheduler as its judge)")
        self.sampler, self.lengths, self.lookahead, self.judge = sampler, lengths, lookahead, judge
        self._window: list[np.ndarray] = []  # this window's batches, in iteration order
        self._states: list[dict] = []  # the drawn sampler's state before each of them
        self._next = 0  # index in the window of the next batch to yield
        self._upcoming: Optional[_Drawn] = None  # the next window, drawn and being judged
        self.last_window: Optional[WindowPlan] = None
        self.windows_planned = self.windows_grouped = 0

    @property
    def batches_per_epoch(self) -> Optional[int]:
        return getattr(self.sampler, "batches_per_epoch", None)

    def __getattr__(self, name: str):
        """Anything else is the wrapped sampler's (e.g. a blend's
        ``consumed_per_dataset(iteration)``, exact at window boundaries: inside a window
        its samples moved between the window's iterations)."""
        if name == "sampler":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __iter__(self) -> "LookaheadSampler":
        return self

    def __next__(self):
        if self.lookahead == 1:
            return next(self.sampler)
        if self._next == len(self._window):
            self._start_window()
        self._next += 1
        self._judge_ahead()
        return [int(i) for i in self._window[self._next - 1]]

    def _draw(self) -> _Drawn:
        """Draws the window starting at the sampler's position."""
        start = self.sampler.iteration
        begin, end = window_span(start, self.lookahead, self.batches_per_epoch)
        if begin != start:
            raise RuntimeError(f"lookahead window drawn from iteration {start}, not its first "
                               f"iteration {begin}")
        states, drawn = [], []
        for _ in range(end - begin):
            states.append(copy.deepcopy(self.sampler.state_dict()))
            drawn.append(np.asarray(next(self.sampler), dtype=np.int64))
        return _Drawn(states, WindowPlanner(drawn, self.lengths, self.judge))

    def _start_window(self) -> None:
        """The next window becomes this one (its remaining judge calls made now)."""
        upcoming, self._upcoming = self._upcoming or self._draw(), None
        plan = upcoming.planner.result()
        self._window, self._states, self._next = list(plan.batches), upcoming.states, 0
        self.last_window = plan
        self.windows_planned += 1
        self.windows_grouped += plan.reordered

    def _judge_ahead(self) -> None:
        """Draws the next window early and judges an even share of it per iteration left
        in this one (2 judge calls per iteration for equal windows), so no iteration's
        planning grows with N."""
        if self._upcoming is None:
            self._upcoming = self._draw()
        left = len(self._window) - self._next + 1  # this iteration included
        self._upcoming.planner.step(-(-self._upcoming.planner.pending // left))

    def state_dict(self) -> dict:
        """The drawn sampler's state before the next batch, plus ``skrull_lookahead``."""
        if self.lookahead == 1:
            return self.sampler.state_dict()
        if self._next < len(self._window):
            state = self._states[self._next]
        elif self._upcoming is not None:
            state = self._upcoming.states[0]
        else:
            state = self.sampler.state_dict()
        return {**copy.deepcopy(state), STATE_KEY: self.lookahead}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at ``state``'s iteration, recomputing its window when it is mid-window.

        Raises:
            ValueError: ``state`` was saved with another ``--skrull-lookahead`` (or the
                wrapped sampler's own checks fail).
        """
        saved = int(state.get(STATE_KEY, 1))
        if saved != self.lookahead:
            raise ValueError(
                f"the checkpoint's data order was planned with --skrull-lookahead {saved} but "
                f"this run has --skrull-lookahead {self.lookahead}; resume with "
                f"--skrull-lookahead {saved} (it decides which samples train in which "
                "iteration)")
        inner = {k: v for k, v in state.items() if k != STATE_KEY}
        if self._rewind(inner):
            return
        self.sampler.load_state_dict(inner)
        self._window, self._states, self._next, self._upcoming = [], [], 0, None
        if self.lookahead == 1:
            return
        target = self.sampler.iteration
        begin, _ = window_span(target, self.lookahead, self.batches_per_epoch)
        if begin != target:  # mid-window: recompute the window from its first batch
            self.sampler.load_state_dict({**inner, "iteration": begin})
            self._start_window()
            self._next = target - begin

    def _rewind(self, inner: dict) -> bool:
        """Moves back inside what is already drawn (the plan-ahead worker's batch undone
        at the end of training): no re-planning.  False when ``inner`` is elsewhere."""
        for k, cached in enumerate(self._states):
            if _same(cached, inner):
                self._next = k
                return True
        if self._upcoming is not None and _same(self._upcoming.states[0], inner):
            self._next = len(self._window)
            return True
        return False


def _same(a: dict, b: dict) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. numpy arrays in a state
        return False


def lookahead_sampler(sampler: Any, lengths: np.ndarray, lookahead: int,
                      batch_scheduler: Callable) -> LookaheadSampler:
    """The training loop's sampler for ``--skrull-lookahead`` (pass-through at N = 1).

    The judge is :func:`~skrull_ext.scheduler.lookahead.scheduler_judge` on the batch
    scheduler's config and the cost model it holds now (the seed: this is called before
    training, so before any online refit); a batch scheduler without them (tests) judges
    with its own plans' predictions.
    """
    config = getattr(batch_scheduler, "config", None)
    cost = getattr(batch_scheduler, "cost_model", None)
    if config is not None and cost is not None:
        judge = scheduler_judge(config, cost)
    else:
        def judge(batch_lengths: np.ndarray) -> float:
            return float(batch_scheduler(batch_lengths).predicted["iteration_time"])
    return LookaheadSampler(sampler, lengths, lookahead, judge if lookahead > 1 else None)
