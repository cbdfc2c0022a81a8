"""``--skrull-lookahead N``: the training sampler's global batches, a window of N at a time.

:class:`LookaheadSampler` is a thin layer over whatever yields the global batches of
sample ids (:class:`megatron.skrull.data.GlobalBatchSampler`, or any sampler with the same
protocol: ``next()``, an ``iteration`` attribute naming the next iteration it yields,
``state_dict()`` / ``load_state_dict()`` honouring an ``"iteration"`` key, and optionally
``batches_per_epoch``).  At a window's first iteration it draws the window's N batches
and hands them to :func:`skrull_ext.scheduler.lookahead.plan_window`, which returns them
regrouped (or as drawn); it then yields them one per iteration.

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
next batch on its worker thread, so a window is planned while the previous iteration
trains.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import numpy as np

from skrull_ext.scheduler.lookahead import Judge, WindowPlan, plan_window, window_span

STATE_KEY = "skrull_lookahead"


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
        self.last_window: Optional[WindowPlan] = None
        self.windows_planned = self.windows_grouped = 0

    @property
    def iteration(self) -> int:
        """The iteration of the next batch."""
        return self.sampler.iteration - (len(self._window) - self._next)

    @property
    def batches_per_epoch(self) -> Optional[int]:
        return getattr(self.sampler, "batches_per_epoch", None)

    def __iter__(self) -> "LookaheadSampler":
        return self

    def __next__(self):
        if self.lookahead == 1:
            return next(self.sampler)
        if self._next == len(self._window):
            self._plan(self.sampler.iteration)
        self._next += 1
        return [int(i) for i in self._window[self._next - 1]]

    def _plan(self, start: int) -> None:
        """Draws the window starting at ``start`` (the sampler's position) and plans it."""
        begin, end = window_span(start, self.lookahead, self.batches_per_epoch)
        if begin != start:
            raise RuntimeError(f"lookahead window drawn from iteration {start}, not its first "
                               f"iteration {begin}")
        states, drawn = [], []
        for _ in range(end - begin):
            states.append(copy.deepcopy(self.sampler.state_dict()))
            drawn.append(np.asarray(next(self.sampler), dtype=np.int64))
        plan = plan_window(drawn, self.lengths, self.judge)
        self._window, self._states, self._next = list(plan.batches), states, 0
        self.last_window = plan
        self.windows_planned += 1
        self.windows_grouped += plan.reordered

    def state_dict(self) -> dict:
        """The drawn sampler's state before the next batch, plus ``skrull_lookahead``."""
        if self.lookahead == 1:
            return self.sampler.state_dict()
        inside = self._next < len(self._window)
        state = copy.deepcopy(self._states[self._next] if inside else self.sampler.state_dict())
        state[STATE_KEY] = self.lookahead
        return state

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
        for k, cached in enumerate(self._states):  # a rewind inside the planned window
            if _same(cached, inner):
                self._next = k
                return
        self.sampler.load_state_dict(inner)
        self._window, self._states, self._next = [], [], 0
        if self.lookahead == 1:
            return
        target = self.sampler.iteration
        begin, _ = window_span(target, self.lookahead, self.batches_per_epoch)
        if begin != target:  # mid-window: recompute the window from its first batch
            self.sampler.load_state_dict({**inner, "iteration": begin})
            self._plan(begin)
            self._next = target - begin


def _same(a: dict, b: dict) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. numpy arrays in a state
        return False


def lookahead_sampler(sampler: Any, lengths: np.ndarray, lookahead: int,
                      batch_scheduler: Callable) -> LookaheadSampler:
    """The training loop's sampler for ``--skrull-lookahead`` (pass-through at N = 1).

    The judge is ``batch_scheduler``'s predicted iteration time under the cost model it
    holds now (the seed: called before training, so before any online refit).
    """
    cost = getattr(batch_scheduler, "cost_model", None)

    def judge(batch_lengths: np.ndarray) -> float:
        plan = (batch_scheduler(batch_lengths) if cost is None
                else batch_scheduler(batch_lengths, cost_model=cost))
        return float(plan.predicted["iteration_time"])

    return LookaheadSampler(sampler, lengths, lookahead, judge if lookahead > 1 else None)
