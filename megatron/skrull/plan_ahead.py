"""Zero exposed planning: the next global batch is scheduled while this one trains.

:class:`PlannedBatches` draws global batches from the sampler and schedules them with the
run's batch scheduler.  With ``ahead=True`` (the default, ``--no-skrull-plan-ahead`` turns
it off) the plan of iteration ``i + 1`` is computed on a worker thread while iteration
``i`` trains; the scheduler's C++ core releases the GIL, and the Python around it is
short next to a training step.  Only the *wait* for a plan not yet finished is exposed:
:attr:`PlannedBatches.exposed_seconds`, shown in the log line.

Determinism: the worker plans the same lengths with a snapshot of the scheduler's cost
model taken at a fixed point of the loop (:meth:`PlannedBatches.prefetch`, called after
the iteration's online refit), which is exactly the model inline planning would use, so
plans are identical with and without the worker, on every rank.

:func:`agree_on_plan` guards that claim at run time: a 63-bit hash of each plan is
compared over the world group with one tiny all-reduce before any micro-batch runs (a
mismatch would otherwise hang the ring or silently train different batches); the same
collective carries the previous iteration's measured time for the online refit.

The sampler's checkpoint state is the one *before* a drawn-ahead batch, so a resumed run
replays exactly the batches the saved run had not trained.
"""
from __future__ import annotations

import concurrent.futures
import copy
import functools
import hashlib
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from skrull_ext.scheduler.plan import Plan

_MASK63 = (1 << 63) - 1


class PlanMismatchError(RuntimeError):
    """Ranks computed different plans for the same iteration."""


class PlannedBatches:
    """``take() -> (dataset ids [K], plan)`` per iteration, planned ahead when asked.

    Args:
        sampler: Global-batch sampler (``next`` -> sample ids; ``state_dict`` /
            ``load_state_dict``).
        lengths: ``[num_samples]`` token counts of the dataset.
        batch_scheduler: ``lengths -> Plan``; if it has a ``cost_model`` attribute the
            worker is given a snapshot of it (``batch_scheduler(lengths, cost_model=...)``).
        ahead: Plan the next batch on a worker thread.
    """

    def __init__(self, sampler: Any, lengths: np.ndarray, batch_scheduler: Callable[..., Plan],
                 *, ahead: bool = True):
        self.sampler, self.lengths, self.batch_scheduler = sampler, lengths, batch_scheduler
        self.ahead = ahead
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "skrull-plan") if ahead else None
        self._pending: Optional[tuple[dict, concurrent.futures.Future]] = None
        self.exposed_seconds = 0.0  # wait of the last take()

    def _plan_fn(self) -> Callable[[np.ndarray], Plan]:
        cost = getattr(self.batch_scheduler, "cost_model", None)
        if cost is None:
            return self.batch_scheduler
        return functools.partial(self.batch_scheduler, cost_model=cost)

    def _draw_and_plan(self, plan_fn: Callable[[np.ndarray], Plan]) -> tuple[np.ndarray, Plan]:
        # The draw runs here too: a --skrull-lookahead sampler plans its window in next().
        ids = np.asarray(next(self.sampler), dtype=np.int64)
        return ids, plan_fn(self.lengths[ids])

    def prefetch(self) -> None:
        """Starts drawing and planning the next batch (no-op inline or when one is pending)."""
        if self._pool is None or self._pending is not None:
            return
        state = copy.deepcopy(self.sampler.state_dict())
        self._pending = (state, self._pool.submit(self._draw_and_plan, self._plan_fn()))

    def take(self) -> tuple[np.ndarray, Plan]:
        """The next batch and its plan; waits for (or computes) the plan."""
        start = time.perf_counter()
        if self._pending is None:
            ids, plan = self._draw_and_plan(self._plan_fn())
        else:
            _, future = self._pending
            self._pending = None
            ids, plan = future.result()
        self.exposed_seconds = time.perf_counter() - start
        return ids, plan

    def state_dict(self) -> dict:
        """Sampler state of the next batch :meth:`take` returns (a pending draw undone)."""
        if self._pending is not None:
            return copy.deepcopy(self._pending[0])
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Drops a pending plan and resumes the sampler from ``state``."""
        self.cancel()
        self.sampler.load_state_dict(state)

    def cancel(self) -> None:
        """Drops a pending plan, rewinding the sampler to before its draw."""
        if self._pending is not None:
            state, future = self._pending
            self._pending = None
            future.cancel()
            concurrent.futures.wait([future])
            self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Stops the worker thread (a pending plan is dropped)."""
        self.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def plan_checksum(plan: Plan) -> int:
    """63-bit hash of everything that decides what each rank runs (lengths, placements)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray([plan.dp_size, plan.cp_size, plan.bucket_size], np.int64).tobytes())
    h.update(np.ascontiguousarray(plan.lengths, dtype=np.int64).tobytes())
    flat = plan.flat
    if flat is not None:
        h.update(np.asarray([len(m) for m in plan.dp_ranks], np.int64).tobytes())
        for arr in (flat.dist_ids, flat.dist_mb, flat.local_ids, flat.local_slot):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        h.update(repr(flat.grouped).encode())
    else:
        h.update(repr(plan.dp_ranks).encode())
    return int.from_bytes(h.digest(), "little") & _MASK63


def agree_on_plan(plan: Plan, *, iteration: int, device: torch.device,
                  measured_seconds: float = 0.0, group=None) -> float:
    """Checks that every rank holds the same plan; returns the max of ``measured_seconds``.

    One all-reduce (MAX) of ``[hash, -hash, seconds]`` over ``group`` (default: world):
    the hashes agree iff ``max(hash) == -max(-hash) == hash``.  Every rank sees the same
    reduced values, so on a mismatch every rank raises (no rank is left waiting).

    Raises:
        PlanMismatchError: The plans differ between ranks.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return measured_seconds
    h = plan_checksum(plan)
    buf = torch.tensor([float(h >> 32), float(h & 0xFFFFFFFF), 0.0, 0.0, measured_seconds],
                       dtype=torch.float64, device=device)
    buf[2:4] = -buf[0:2]  # 32-bit halves are exact in float64
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    hi, lo, neg_hi, neg_lo, seconds = buf.tolist()
    if (hi, lo) != (-neg_hi, -neg_lo):
        raise PlanMismatchError(
            f"iteration {iteration}: ranks computed different Skrull plans (checksums "
            "differ); every rank must see the same lengths, flags and cost model -- check "
            "that --skrull-* flags, SKRULL_IMPL and the dataset are identical on all nodes")
    return seconds
