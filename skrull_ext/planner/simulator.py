"""Iteration-time simulator: a plan on a hardware preset, per DP rank, micro-batch and CP rank.

It runs on the scheduler's own time model: every constant comes from a
:class:`~skrull_ext.costmodel.model.CostModel` (the hardware's
:meth:`~skrull_ext.costmodel.hardware.Hardware.cost_model`, or one given, e.g. calibrated
on a GPU), and its terms are the ones the scheduler prices (docs/scheduler.md, "One time
model").  What it adds is the detail the scheduler's per-sample arrays cannot carry.  For
every micro-batch and CP rank ``r`` (times are forward + backward, all layers):

* **linear**: ``c_linear x linear FLOPs`` of the ``T_r`` tokens the rank holds, zigzag
  padding included, *outside* the ring (with tensor parallelism, folded into
  ``c_linear``, also its activation collectives); the matmuls' fixed cost per micro-batch
  (weights streamed however few the tokens) is in the cost model's micro-batch overhead.
* **local attention**: per local sequence its whole attention at its length's efficiency.
* **distributed attention**: every distributed sequence is padded to ``pad(S)`` and split
  zigzag, so each of the ``N`` ring steps computes ``1/N^2`` of its causal FLOPs on every
  rank, at the efficiency of a block of ``pad(S)/N`` queries; every step also pays the
  cost model's ``ring_step_overhead``.
* **ring communication**, per layer and per ring step, forward and backward separately.
  Forward: ``N - 1`` steps each moving the KV of *all* distributed shards of the
  micro-batch (``2 * shard * h_kv * bytes`` per sequence) in one message; backward:
  ``N - 1`` steps moving KV and dK/dV (twice the bytes), then one message returning dK/dV
  to its owner.  A step takes ``latency + bytes x seconds per byte`` (the cost model's
  :meth:`~skrull_ext.costmodel.model.CommModel.linear_fit`; a sub-group ring uses the
  hardware's link for its size).
* **overlap** (docs/design.md section 5): step 0 computes the local sequences plus the rank's
  own block while the first exchange is in flight; rank ``r`` starts step ``i`` when it
  finished step ``i - 1`` and received the block, which rank ``r - 1`` sends when it starts
  its step ``i - 1`` (and the link is free).  Without overlap, a step's transfer starts
  when both ends finished their previous step.  This event recursion couples the ranks:
  a rank with more local work forwards late and delays its successors.
* **barrier per layer**: each layer's ring starts with the CP ranks aligned (a ring cannot
  end before its slowest member has forwarded every block); as all layers are alike, the
  micro-batch takes the slowest rank's time, plus the fixed per-micro-batch overhead.
  Hybrid-CP sub-group rings (``grouped``) run after the full ring, unoverlapped with local
  work.
* The DP rank runs its micro-batches one after another; the iteration ends with the slowest
  DP rank, followed by the cost model's iteration overhead (on a preset: the gradient
  all-reduce over the ``D x N`` ranks holding replicas, ``2 (n-1)/n * params * grad_bytes /
  bus bandwidth``, and the fixed step overhead, ``Hardware.step_overhead_s``).

The scheduler's :func:`~skrull_ext.scheduler.predict` composes the same terms in closed
form; what differs: it lets a rank's local linear work hide the first exchange, it takes
each rank's time alone where the event recursion couples them, and its sub-group rings use
the full ring's link.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from skrull_ext.costmodel.model import ATTENTION_TRAIN_FACTOR, CostModel, ModelSpec
from skrull_ext.costmodel.hardware import Hardware, get_hardware
from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.sharding import shard_tokens

_ATT_FWD = 1.0 / ATTENTION_TRAIN_FACTOR  # forward share of attention training FLOPs
COMPONENTS = ("linear", "attention_local", "attention_dist", "comm_exposed")


def ring_finish(local, block, comm: float, *, overlap: bool, ret: float = 0.0) -> np.ndarray:
    """Finish time of one layer's ring on every CP rank (all start at 0).

    Args:
        local: ``[N]`` seconds of local attention per rank (computed in step 0).
        block: ``[N]`` seconds of one ring step's distributed blocks per rank.
        comm: Seconds of one step's transfer.
        overlap: Transfers overlap compute (see the module docstring).
        ret: Seconds of the final message that returns dK/dV to its owner (backward).

    Returns:
        ``[N]`` seconds.
    """
    local = np.asarray(local, dtype=np.float64)
    block = np.broadcast_to(np.asarray(block, dtype=np.float64), local.shape)
    n = local.size
    start = np.zeros(n)
    finish = local + block
    link_free = np.zeros(n)
    for _ in range(1, n):
        if overlap:  # both ends posted at the start of their previous step
            begin = np.maximum(np.maximum(np.roll(start, 1), start), link_free)
        else:
            begin = np.maximum(np.roll(finish, 1), finish)
        arrive = begin + comm
        link_free = arrive
        start = np.maximum(finish, arrive)
        finish = start + block
    if ret > 0.0 and n > 1:
        finish = np.maximum(finish, np.roll(finish, 1) + ret)
    return finish


def _uniform_ring(local: float, block: float, comm: float, n: int, overlap: bool,
                  ret: float = 0.0) -> float:
    """Closed form of :func:`ring_finish` when every rank has the same work."""
    if n <= 1:
        return local + block
    if overlap:
        t = max(local + block, comm) + block + (n - 2) * max(block, comm)
    else:
        t = local + block + (n - 1) * (comm + block)
    return t + ret


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Simulated iteration of one plan; arrays are ``[D, M, N]`` unless noted (seconds).

    Attributes:
        policy: The plan's policy.
        hardware: Preset name.
        iteration_time: ``compute_time + grad_reduce_time + step_time``.
        compute_time: Slowest DP rank's sum of micro-batch times.
        grad_reduce_time: Gradient all-reduce at the end.
        step_time: Fixed per-iteration seconds (optimizer step; ``Hardware.step_overhead_s``).
        lower_bound: Total minimal compute spread over all ``D N`` ranks, plus one
            micro-batch's fixed overhead and the gradient reduction (see :func:`lower_bound`).
        dp_rank_times: ``[D]`` compute seconds per DP rank.
        mb_times / mb_starts: ``[D, M]`` duration and start of each micro-batch.
        linear, attention_local, attention_dist, comm_exposed: per-rank components;
            ``comm_exposed`` is ring time not hidden behind compute (waits included).
        overhead: ``[D, M]`` fixed seconds of each non-empty micro-batch.
        comm_total: ``[D, M]`` ring seconds if no transfer overlapped anything.
        tokens / padding: ``[D, M, N]`` tokens held (padding included) / padding tokens.
    """

    policy: str
    hardware: str
    iteration_time: float
    compute_time: float
    grad_reduce_time: float
    lower_bound: float
    dp_rank_times: np.ndarray
    mb_times: np.ndarray
    mb_starts: np.ndarray
    linear: np.ndarray
    attention_local: np.ndarray
    attention_dist: np.ndarray
    comm_exposed: np.ndarray
    overhead: np.ndarray
    comm_total: np.ndarray
    tokens: np.ndarray
    padding: np.ndarray
    step_time: float = 0.0

    def busy(self) -> np.ndarray:
        """``[D, M, N]`` seconds each rank works or waits on the ring."""
        return self.linear + self.attention_local + self.attention_dist + self.comm_exposed

    def idle(self) -> np.ndarray:
        """``[D, M, N]`` seconds each rank waits for the slowest CP rank of the micro-batch."""
        return np.maximum(self.mb_times[..., None] - self.overhead[..., None] - self.busy(), 0.0)

    def segments(self, dp_rank: int) -> list[dict]:
        """Timeline bars of one DP rank: ``{cp_rank, micro_batch, kind, start, duration}``.

        Per micro-batch and CP rank the components are laid end to end (aggregated over
        layers): overhead, linear, local attention, distributed attention, exposed
        communication, idle; then the gradient reduction of the iteration.
        """
        out = []
        d = dp_rank
        kinds = ("overhead",) + COMPONENTS + ("idle",)
        idle = self.idle()
        for m in range(self.mb_times.shape[1]):
            for r in range(self.linear.shape[2]):
                t = float(self.mb_starts[d, m])
                for kind in kinds:
                    if kind == "overhead":
                        dur = float(self.overhead[d, m])
                    elif kind == "idle":
                        dur = float(idle[d, m, r])
                    else:
                        dur = float(getattr(self, kind)[d, m, r])
                    if dur > 0:
                        out.append({"cp_rank": r, "micro_batch": m, "kind": kind,
                                    "start": t, "duration": dur})
                    t += dur
        for r in range(self.linear.shape[2]):
            if self.grad_reduce_time > 0:
                out.append({"cp_rank": r, "micro_batch": -1, "kind": "grad_reduce",
                            "start": self.compute_time, "duration": self.grad_reduce_time})
        return out

    def summary(self) -> dict:
        """Scalars: times, totals of every component, padding share."""
        tok = float(self.tokens.sum())
        return {
            "policy": self.policy, "hardware": self.hardware,
            "iteration_time": self.iteration_time, "compute_time": self.compute_time,
            "grad_reduce_time": self.grad_reduce_time, "lower_bound": self.lower_bound,
            "num_micro_batches": int(self.mb_times.shape[1]),
            **{k: float(getattr(self, k).sum()) for k in COMPONENTS},
            "padding_share": float(self.padding.sum()) / tok if tok else 0.0,
        }


class _Context:
    """Per-plan precomputation: per-sample seconds and message bytes (``[K]`` arrays)."""

    def __init__(self, plan: Plan, model: ModelSpec, hw: Optional[Hardware], overlap: bool,
                 cost: CostModel):
        self.model, self.hw, self.overlap, self.cost = model, hw, overlap, cost
        self.n = n = plan.cp_size
        self.layers = model.num_layers
        self.lengths = plan.lengths
        tm = cost.time
        self.lin_per_token = cost.ring_terms[0]  # c_linear x linear FLOPs of one token
        self.call = tm.attention_call_overhead * self.layers
        self.step = tm.ring_step_overhead  # per ring step and layer
        self.att_local = self.attention(plan.lengths.astype(np.float64))
        shard = np.array([shard_tokens(int(x), n) for x in plan.lengths], dtype=np.float64)
        self.shard = shard
        # Per rank, all N steps together (N kernel calls per sequence and layer).
        self.att_dist = self.blocks(shard, n)
        self.kv_per_token = 2.0 * model.kv_hidden_size * cost.bytes_per_element
        self.kv_bytes = self.kv_per_token * shard
        self.comm = cost.comm
        self.fixed = cost.micro_batch_overhead

    def attention(self, lengths: np.ndarray) -> np.ndarray:
        """Seconds of each sequence's whole attention on one rank (one call per layer)."""
        tm = self.cost.time
        return (tm.c_attention * self.model.attention_flops(lengths)
                * (1.0 + tm.attention_half_tokens / np.maximum(lengths, 1.0)) + self.call)

    def blocks(self, shard: np.ndarray, size: int) -> np.ndarray:
        """Seconds each of ``size`` ranks spends on the attention blocks of sequences with
        ``shard`` tokens per rank (``1/size`` of the padded sequence's FLOPs)."""
        tm = self.cost.time
        return (tm.c_attention * self.model.attention_flops(shard * size) / size
                * (1.0 + tm.attention_half_tokens / shard) + size * self.call)

    def link(self, size: int):
        """The step-time model of a ring over ``size`` ranks (the hardware's link for that
        size; the cost model's own when it was given)."""
        if self.hw is None or size == self.n:
            return self.comm
        return self.hw.ring_comm(size)

    def linear(self, tokens: np.ndarray) -> np.ndarray:
        """Matmul seconds per rank (and the TP collectives of its tokens, with TP)."""
        return np.where(tokens > 0, self.lin_per_token * tokens, 0.0)

    def ring(self, local: np.ndarray, block: float, msg: float, n: int, comm) -> tuple:
        """``(attention + exposed comm [N], unoverlapped comm seconds)`` over all layers."""
        latency, per_byte = comm.linear_fit()
        cf, cb, cr = (latency + per_byte * x for x in (msg, 2.0 * msg, msg))
        per_layer = []
        for share, c, ret in ((_ATT_FWD, cf, 0.0), (1.0 - _ATT_FWD, cb, cr)):
            lo = local * share / self.layers
            bl = (block / self.layers + self.step) * share
            if np.all(lo == lo[0]):
                per_layer.append(np.full(lo.shape, _uniform_ring(float(lo[0]), bl, c, n,
                                                                  self.overlap, ret)))
            else:
                per_layer.append(ring_finish(lo, bl, c, overlap=self.overlap, ret=ret))
        total_comm = self.layers * ((n - 1) * (cf + cb) + cr)
        return self.layers * (per_layer[0] + per_layer[1]), total_comm

    def grouped(self, mb: MicroBatch, att_dist: np.ndarray, exposed: np.ndarray) -> float:
        """Adds hybrid-CP sub-group rings (in place); returns their unoverlapped comm.

        One ring per sub-group ``(first, size)`` carrying all its samples' blocks and K/V
        in one message per step, as the DACP attention runs them (after the full ring).
        """
        total = 0.0
        rings: dict[tuple[int, int], list] = {}
        for i, first, size in mb.grouped:
            sh = float(shard_tokens(int(self.lengths[i]), size))
            ring = rings.setdefault((int(first), int(size)), [0.0, 0.0])
            ring[0] += float(self.blocks(np.array([sh]), size)[0])
            ring[1] += self.kv_per_token * sh
        for (first, size), (work, msg) in sorted(rings.items()):
            t, comm = self.ring(np.zeros(size), work / size, msg, size, self.link(size))
            work += size * self.step * self.layers  # the ring steps' fixed cost
            att_dist[first:first + size] += work
            exposed[first:first + size] += t - work
            total += comm
        return total

    def micro_batch(self, mb: MicroBatch) -> dict:
        """Per-rank components of one micro-batch (``[N]`` arrays) and its duration."""
        n = self.n
        tokens = np.asarray(mb.rank_tokens(self.lengths), dtype=np.float64)
        true = np.array([float(sum(int(self.lengths[i]) for i in r)) for r in mb.local])
        dist = np.asarray(mb.distributed, dtype=np.int64)
        true += float(self.lengths[dist].sum()) / n
        true += np.array([sum(float(self.lengths[i]) / g for i, f, g in mb.grouped
                              if f <= r < f + g) for r in range(n)])
        local = np.array([float(self.att_local[list(r)].sum()) for r in mb.local])
        block = float(self.att_dist[dist].sum())
        comm_total = 0.0
        if dist.size and n > 1:
            ring, comm_total = self.ring(local, block / n, float(self.kv_bytes[dist].sum()), n,
                                         self.comm)
            block += n * self.step * self.layers  # the ring steps' fixed cost
            exposed = ring - local - block
        else:
            exposed = np.zeros(n)
        att_dist = np.full(n, block)
        comm_total += self.grouped(mb, att_dist, exposed)
        out = {"linear": self.linear(tokens), "attention_local": local,
               "attention_dist": att_dist, "comm_exposed": np.maximum(exposed, 0.0),
               "tokens": tokens, "padding": np.maximum(tokens - true, 0.0),
               "comm_total": comm_total}
        busy = sum(out[k] for k in COMPONENTS)
        out["overhead"] = 0.0 if mb.is_empty() else self.fixed
        out["time"] = 0.0 if mb.is_empty() else float(busy.max()) + self.fixed
        return out


def _cost_model(model: ModelSpec, hw: Optional[Hardware], cp_size: int, dp_size: int,
                cost_model: Optional[CostModel]) -> CostModel:
    if cost_model is not None:
        return cost_model
    if hw is None:
        raise ValueError("simulate needs a hardware preset or a cost model")
    return hw.cost_model(model, cp_size, dp_size)


def lower_bound(lengths, model: ModelSpec, hardware: Optional[Hardware], dp_size: int,
                cp_size: int, *, cost_model: Optional[CostModel] = None) -> float:
    """Ideal iteration time: every sequence's minimal compute spread over all ``D N`` ranks.

    A sequence's minimal compute is its cost whole on one rank (sharding only shrinks
    blocks and adds padding, lowering the rate).  Adds one micro-batch's fixed overhead
    and the iteration overhead (gradient reduction, step), which no plan avoids.
    """
    cost = _cost_model(model, hardware, cp_size, dp_size, cost_model)
    s = np.asarray(lengths, dtype=np.int64)
    work = float(cost.compute_seconds(s).sum()) if s.size else 0.0
    return (work / (dp_size * cp_size) + cost.micro_batch_overhead
            + cost.time.iteration_overhead)


def simulate(plan: Plan, model: ModelSpec, hardware: Hardware | str | None = "h100", *,
             overlap: Optional[bool] = None, cost_model: Optional[CostModel] = None
             ) -> SimResult:
    """Simulates one iteration of ``plan``.

    Args:
        plan: A validated plan (``lengths`` ``[K]``, ``dp_ranks[d][m]``).
        model: Model shape (FLOPs, KV size, parameters).
        hardware: A :class:`Hardware` or preset name: its
            :meth:`~skrull_ext.costmodel.hardware.Hardware.cost_model` gives the constants,
            its links the sub-group rings'; ``None`` with ``cost_model``.
        overlap: Override ``hardware.overlap`` (ring transfers overlapping compute).
        cost_model: Run on this cost model instead (e.g. a calibrated one: the same file
            that seeds the scheduler), every ring on its link.

    Returns:
        :class:`SimResult` with ``[D, M, N]`` per-rank components.
    """
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    d, m, n = plan.dp_size, plan.num_micro_batches, plan.cp_size
    cost = _cost_model(model, hw, n, d, cost_model)
    if overlap is None:
        overlap = hw.overlap if hw is not None else True
    ctx = _Context(plan, model, hw if cost_model is None else None, overlap, cost)
    arrays = {k: np.zeros((d, m, n)) for k in COMPONENTS + ("tokens", "padding")}
    mb_times, overhead, comm_total = np.zeros((d, m)), np.zeros((d, m)), np.zeros((d, m))
    for i, mbs in enumerate(plan.dp_ranks):
        for j, mb in enumerate(mbs):
            res = ctx.micro_batch(mb)
            for k in arrays:
                arrays[k][i, j] = res[k]
            mb_times[i, j], overhead[i, j] = res["time"], res["overhead"]
            comm_total[i, j] = res["comm_total"]
    rank_times = mb_times.sum(axis=1)
    starts = np.cumsum(mb_times, axis=1) - mb_times
    compute = float(rank_times.max()) if d else 0.0
    if cost_model is None:
        grad = hw.grad_reduce_seconds(model.param_count(), d * n)
        step = cost.time.iteration_overhead - grad
    else:
        grad, step = 0.0, cost.time.iteration_overhead
    return SimResult(
        policy=plan.policy, hardware=hw.name if hw is not None else "cost-model",
        iteration_time=compute + cost.time.iteration_overhead,
        compute_time=compute, grad_reduce_time=grad, step_time=step,
        lower_bound=lower_bound(plan.lengths, model, hw, d, n, cost_model=cost),
        dp_rank_times=rank_times, mb_times=mb_times, mb_starts=starts, overhead=overhead,
        comm_total=comm_total, **arrays)


__all__ = ["COMPONENTS", "SimResult", "lower_bound", "ring_finish", "simulate"]
