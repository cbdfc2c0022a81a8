"""Pipeline parallelism in the simulator and the memory model (ours; the Skrull paper has no PP).

Model of one iteration with ``P`` pipeline stages (Megatron's non-interleaved 1F1B schedule,
``forward_backward_pipelining_without_interleaving``), per DP rank:

* **stage time**: every stage holds ``num_layers / P`` layers, so a micro-batch's forward on
  one stage takes ``t_m / P * f`` and its backward ``t_m / P * (1 - f)``, ``t_m`` the
  whole-model micro-batch time of :func:`~skrull_ext.planner.simulator.simulate` (slowest
  CP rank, ring and overheads included) and ``f = 1/3`` (backward = 2 x forward).
* **P2P**: between stages every CP rank sends its activations ``[T_r, 1, h]`` forward and
  their gradients backward; the message of the CP rank holding the most tokens decides
  (``max_r T_r * h * activation_bytes`` on the link between stages: intra-node while the
  whole ``D x N x P`` layout fits a node, else inter-node).
* **1F1B order**: stage ``s`` runs ``min(P - s - 1, M)`` warm-up forwards, then alternates
  one forward and one backward, then drains the backwards.  An operation starts when its
  stage finished the previous one and its input arrived (forward from stage ``s - 1``,
  backward from stage ``s + 1``; the last stage's backward follows its forward).  Sends do
  not block the sender.  Uneven micro-batches make stages wait: that is the bubble.
* **ordering**: the order micro-batches enter the pipeline changes the bubble (a long one
  first delays every stage's warm-up; a long one last lengthens the drain).
  :func:`order_micro_batches` tries a few deterministic orders under this model and keeps
  the fastest; the training loop may feed any order as long as every stage uses the same.
* **gradients**: each stage reduces its own parameters (``1/P`` of the layers, the
  embedding on the first stage, the output layer on the last) over ``D x N`` ranks, and
  tied embeddings add one all-reduce of the word-embedding gradient between the first and
  last stage.

Memory (:func:`pipeline_bucket`): under 1F1B stage ``s`` keeps the activations of up to
``P - s`` micro-batches alive.  Our simplest faithful choice: each stage's activation
memory (device - its static memory - margin) divided by its in-flight count and its bytes
per token gives a per-micro-batch bucket; the bucket is the smallest over stages (stage 0,
with ``P`` in flight, decides unless the last stage's logits dominate).  Every micro-batch
holds at most ``bucket`` tokens per rank, so the in-flight sum stays within memory.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from skrull_ext.costmodel.hardware import Hardware, get_hardware
from skrull_ext.costmodel.model import ModelSpec
from skrull_ext.planner.simulator import SimResult, lower_bound, simulate
from skrull_ext.scheduler.plan import Plan

FORWARD_SHARE = 1.0 / 3.0  # backward = 2 x forward (linear layers dominate)
ORDERS = ("plan", "ascending", "descending", "small-ends")


def one_f_one_b(pp_size: int, stage: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """Operation order of one stage under non-interleaved 1F1B: ``[("F"|"B", m), ...]``."""
    m = num_micro_batches
    warmup = min(pp_size - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def pipeline_times(fwd: Sequence[float], bwd: Sequence[float], p2p: Sequence[float],
                   pp_size: int) -> tuple[float, np.ndarray]:
    """Makespan of 1F1B over ``P`` stages with per-micro-batch stage times.

    Args:
        fwd: ``[M]`` seconds of one stage's forward of each micro-batch (in feed order).
        bwd: ``[M]`` seconds of one stage's backward.
        p2p: ``[M]`` seconds to send one micro-batch's activations (or their gradient)
            to the neighbouring stage.
        pp_size: Stages ``P``.

    Returns:
        ``(makespan, busy [P])``: the last stage to finish, and each stage's compute
        seconds (so ``1 - busy / makespan`` is its bubble share).
    """
    fwd, bwd, p2p = (np.asarray(x, dtype=np.float64) for x in (fwd, bwd, p2p))
    m, p = fwd.size, pp_size
    if m == 0:
        return 0.0, np.zeros(p)
    f_end = np.full((p, m), np.nan)
    b_end = np.full((p, m), np.nan)
    ops = [one_f_one_b(p, s, m) for s in range(p)]
    pos, clock = [0] * p, np.zeros(p)
    remaining = 2 * m * p
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(ops[s]):
                kind, i = ops[s][pos[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else f_end[s - 1, i] + p2p[i]
                else:
                    ready = f_end[s, i] if s == p - 1 else b_end[s + 1, i] + p2p[i]
                if np.isnan(ready):
                    break  # input not produced yet: let the other stages run
                clock[s] = max(clock[s], ready) + (fwd[i] if kind == "F" else bwd[i])
                (f_end if kind == "F" else b_end)[s, i] = clock[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # 1F1B never deadlocks; guard against a broken order
            raise RuntimeError("1F1B simulation made no progress")
    return float(clock.max()), np.full(p, float((fwd + bwd).sum()))


def order_micro_batches(times: Sequence[float], order: str) -> np.ndarray:
    """A feed order of micro-batches: ``[M]`` permutation of their indices.

    ``plan`` keeps the plan's order; ``ascending``/``descending`` sort by time;
    ``small-ends`` puts the shortest first, the second shortest last and the rest
    longest-first in between (short fill and short drain).
    """
    t = np.asarray(times, dtype=np.float64)
    idx = np.arange(t.size)
    if order == "plan" or t.size < 2:
        return idx
    asc = np.argsort(t, kind="stable")
    if order == "ascending":
        return asc
    if order == "descending":
        return asc[::-1].copy()
    if order == "small-ends":
        return np.concatenate([asc[:1], asc[2:][::-1], asc[1:2]])
    raise ValueError(f"unknown micro-batch order {order!r}; choose from {ORDERS}")


def stage_param_count(model: ModelSpec, pp_size: int, stage: int) -> int:
    """Parameters held by one stage: its layers, the embedding (first), norm + output (last).

    With tied embeddings and ``P > 1`` the last stage keeps its own copy of the word
    embedding as output layer (as Megatron-Core does) and the two are all-reduced.
    """
    per_layer = model.param_count() - model.vocab_size * model.hidden_size * (
        1 if model.tied_embeddings else 2) - model.hidden_size
    per_layer //= model.num_layers
    vh = model.vocab_size * model.hidden_size
    count = per_layer * model.num_layers // pp_size
    if stage == 0:
        count += vh
    if stage == pp_size - 1:
        count += model.hidden_size
        if not model.tied_embeddings or pp_size > 1:
            count += vh
    return count


def check_pipeline(model: ModelSpec, pp_size: int) -> None:
    """Raises ``ValueError`` naming the fix when the layers do not split into ``P`` stages."""
    if pp_size < 1:
        raise ValueError(f"--pp-size must be >= 1, got {pp_size}")
    if model.num_layers % pp_size:
        raise ValueError(f"{model.num_layers} layers do not split into --pp-size {pp_size} "
                         "equal stages; choose a divisor of the layer count")


def pipeline_bucket(model: ModelSpec, hw: Hardware, *, pp_size: int, optimizer_shards: int,
                    device_bytes: float, margin_bytes: float,
                    alpha: Optional[float] = None,
                    static_bytes_per_param: Optional[float] = None) -> tuple[int, dict]:
    """Largest per-rank micro-batch bucket whose 1F1B in-flight sum fits every stage.

    Args:
        model: Model shape.
        hw: Element sizes (weights and activations in ``hw.activation_bytes``).
        pp_size: Stages ``P``.
        optimizer_shards: Ranks the optimizer state is sharded over (``D x N``).
        device_bytes, margin_bytes: Device memory and the share kept free.
        alpha: Whole-model activation bytes per token (default: the model estimate); a
            stage's share follows the model's split between layers and logits.
        static_bytes_per_param: Weights + grads + optimizer bytes per parameter (default:
            ``hw`` element sizes and 12 bytes of Adam state sharded over the shards).

    Returns:
        ``(bucket, info)``; ``info`` has per-stage static bytes, bytes per token and
        micro-batches in flight.  ``bucket < 1`` means no room (the caller reports it).
    """
    check_pipeline(model, pp_size)
    scale = hw.activation_bytes / 2.0  # the model's estimate is for bf16 activations
    total = model.activation_bytes_per_token() * scale
    logits = model.activation_bytes_per_token(num_layers=0) * scale
    factor = 1.0 if alpha is None else alpha / total
    buckets, stages = [], []
    for s in range(pp_size):
        per_param = static_bytes_per_param or (
            hw.activation_bytes + hw.grad_bytes + 12.0 / optimizer_shards)
        static = stage_param_count(model, pp_size, s) * per_param
        per_token = factor * ((total - logits) / pp_size + (logits if s == pp_size - 1 else 0))
        in_flight = pp_size - s
        buckets.append(int((device_bytes - static - margin_bytes) // (in_flight * per_token)))
        stages.append({"static_bytes": static, "bytes_per_token": per_token,
                       "in_flight": in_flight, "bucket": buckets[-1]})
    return min(buckets), {"stages": stages}


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """Simulated iteration of one plan on ``P`` stages.

    Attributes:
        pp_size: Stages.
        order: Feed order used (see :func:`order_micro_batches`).
        iteration_time: Slowest DP rank's 1F1B makespan + gradient reductions + step.
        compute_time: Slowest DP rank's makespan.
        bubble_share: ``1 - busy / makespan`` of that DP rank's busiest stage.
        ideal_time: Its compute with no bubble and no P2P: ``sum(t_m) / P``.
        grad_reduce_time: Largest stage's gradient reduction plus the tied-embedding one.
        lower_bound: The whole-model bound with compute spread over ``D x N x P`` ranks
            and the smallest stage's gradient reduction (no bubble, no P2P).
        base: The whole-model simulation the stage times come from.
        orders: ``[D]`` feed order of every DP rank's micro-batches.
    """

    pp_size: int
    order: str
    iteration_time: float
    compute_time: float
    bubble_share: float
    ideal_time: float
    grad_reduce_time: float
    lower_bound: float
    base: SimResult
    orders: tuple


def simulate_pipeline(plan: Plan, model: ModelSpec, hardware: Hardware | str = "h100", *,
                      pp_size: int = 1, order: str = "plan") -> PipelineResult:
    """Simulates one iteration of ``plan`` with ``P`` pipeline stages per DP x CP replica.

    Args:
        plan: A validated plan.
        model: Model shape (``num_layers`` divisible by ``pp_size``).
        hardware: Preset or :class:`Hardware`.
        pp_size: Pipeline stages.
        order: Micro-batch feed order (:data:`ORDERS`), or ``best``: the fastest of them.

    Returns:
        :class:`PipelineResult`.
    """
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    check_pipeline(model, pp_size)
    base = simulate(plan, model, hw)
    if order == "best":
        runs = [simulate_pipeline(plan, model, hw, pp_size=pp_size, order=o) for o in ORDERS]
        return min(runs, key=lambda r: r.iteration_time)
    d, n, p = plan.dp_size, plan.cp_size, pp_size
    link = hw.intra_node_comm if d * n * p <= hw.gpus_per_node else hw.inter_node_comm
    best = (-1.0, 0.0, 0.0)
    orders = []
    for i in range(d):
        keep = np.flatnonzero(base.mb_times[i] > 0)  # empty micro-batches are not fed
        perm = keep[order_micro_batches(base.mb_times[i, keep], order)]
        orders.append(tuple(int(x) for x in perm))
        t = base.mb_times[i, perm] / p
        msg = base.tokens[i, perm].max(axis=1) * model.hidden_size * hw.activation_bytes
        comm = np.asarray(link.time(msg)) if p > 1 else np.zeros(perm.size)
        span, busy = pipeline_times(t * FORWARD_SHARE, t * (1 - FORWARD_SHARE), comm, p)
        if span > best[0]:
            best = (span, float(busy.max()), float(t.sum()))
    span, busy, ideal = best
    params = [stage_param_count(model, p, s) for s in range(p)]
    grad = hw.grad_reduce_seconds(max(params), d * n)
    if p > 1 and model.tied_embeddings:
        grad += hw.grad_reduce_seconds(model.vocab_size * model.hidden_size, 2)
    bound = (lower_bound(plan.lengths, model, hw, d * p, n)
             - hw.grad_reduce_seconds(model.param_count(), d * n * p)
             + hw.grad_reduce_seconds(min(params), d * n))
    return PipelineResult(
        pp_size=p, order=order, iteration_time=span + grad + hw.step_overhead_s,
        compute_time=span, bubble_share=max(1.0 - busy / span, 0.0) if span > 0 else 0.0,
        ideal_time=ideal, grad_reduce_time=grad, lower_bound=bound, base=base, orders=tuple(orders))


__all__ = ["FORWARD_SHARE", "ORDERS", "PipelineResult", "check_pipeline", "one_f_one_b",
           "order_micro_batches", "pipeline_bucket", "pipeline_times", "simulate_pipeline",
           "stage_param_count"]
