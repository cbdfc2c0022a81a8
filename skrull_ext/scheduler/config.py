"""How to schedule: :class:`SchedulerConfig` and the input error every entry point raises.

Its own module so that the scheduler's parts (:mod:`~skrull_ext.scheduler.hybrid` and the
rest) can name the config without importing the package that imports them.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from skrull_ext.scheduler.baselines import BASELINES, NEEDS_EXTRAS
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS

POLICIES = ("skrull",) + tuple(BASELINES)
# What comparisons run unless told otherwise: every policy but those needing extras.
DEFAULT_POLICIES = tuple(p for p in POLICIES if p not in NEEDS_EXTRAS)
_ROLLBACK_CODES = {"shortest": 0, "best-fit": 1, "auto": 2}
_VARIANT_CODES = {"paper": 0, "balanced": 1, "lpt": 2, "auto": 3}


class ScheduleInputError(ValueError):
    """The global batch cannot be scheduled as given; the message names the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How to schedule.

    Attributes:
        dp_size: Data-parallel degree ``D`` (>= 1).
        cp_size: Context-parallel degree ``N`` (>= 1).
        bucket_size: Most tokens per CP rank per micro-batch (``--skrull-bucket-size``).
        policy: ``skrull`` or a baseline name (see ``POLICIES``).
        rollback: DACP roll-back victim choice: ``shortest`` (the paper), ``best-fit``
            (ours) or ``auto`` (both, keep the faster micro-batch).
        dacp: DACP step a: ``paper`` (keep every sequence that fits local), ``balanced``
            (ours: distribute when that lowers the micro-batch objective), ``lpt`` (ours:
            distribute the ``k`` longest, pack the rest by LPT, best ``k``) or ``auto``
            (all three, keep the fastest micro-batch).
        portfolio: (ours) Also place the baselines' groupings with DACP and keep the
            fastest plan (:mod:`skrull_ext.scheduler.portfolio`); ``False`` runs GDS alone.
        plan_budget_ms: (ours) Local-search refinement budget of the portfolio's plan
            (``--skrull-plan-budget-ms``; :mod:`skrull_ext.scheduler.refine`), converted to
            a deterministic work count (the same plan on every rank); 0 disables it.
        subgroups: (ours) Let Skrull keep hybrid CP's plan, CP sub-group rings included,
            when predicted faster (:func:`~skrull_ext.scheduler.hybrid.candidate`); off
            where the attention cannot run sub-group rings (Transformer Engine without
            flash-attn).
    """

    dp_size: int
    cp_size: int
    bucket_size: int
    policy: str = "skrull"
    rollback: str = "auto"
    dacp: str = "auto"
    portfolio: bool = True
    plan_budget_ms: float = DEFAULT_BUDGET_MS
    subgroups: bool = True

    def __post_init__(self):
        for name, flag in (("dp_size", "--dp-size"), ("cp_size", "--cp-size / --context-parallel-size"),
                           ("bucket_size", "--bucket-size / --skrull-bucket-size")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ScheduleInputError(f"{name} must be an integer >= 1, got {value!r}: fix {flag}")
        if self.policy not in POLICIES:
            raise ScheduleInputError(f"unknown policy {self.policy!r}: choose one of {POLICIES}")
        if self.rollback not in _ROLLBACK_CODES:
            raise ScheduleInputError(
                f"unknown rollback {self.rollback!r}: choose one of {tuple(_ROLLBACK_CODES)}")
        if self.dacp not in _VARIANT_CODES:
            raise ScheduleInputError(
                f"unknown dacp variant {self.dacp!r}: choose one of {tuple(_VARIANT_CODES)}")
        budget = self.plan_budget_ms
        if (isinstance(budget, bool) or not isinstance(budget, (int, float, np.number))
                or not 0 <= budget < 1e6):
            raise ScheduleInputError(
                f"plan budget must be a number of ms in [0, 1e6), got {budget!r}: fix "
                "--skrull-plan-budget-ms")
        if self.bucket_size < 2 * self.cp_size and self.cp_size > 1:
            raise ScheduleInputError(
                f"bucket size {self.bucket_size} is smaller than one padded token pair per rank "
                f"(2 x cp_size = {2 * self.cp_size}); raise --skrull-bucket-size")
