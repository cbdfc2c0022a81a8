"""The per-iteration batch scheduler: global-batch lengths -> a
:class:`skrull_ext.scheduler.plan.Plan`.

Every rank calls the batch scheduler with the same lengths and gets the same plan (the scheduler
is deterministic), so no plan is ever broadcast.  The cost model comes from the run's
model shape and a :mod:`skrull_ext.costmodel.hardware` preset chosen by ``--skrull-hardware``
(``h100``: the paper's H100 NVLink numbers; ``cpu``: fitted to real training iterations of
this stack on CPU with gloo, ``benchmarks/calibrate_training_cpu.py``; default: from the
device), optionally overridden by ``--skrull-cost-model-config FILE``, a JSON object with
any of::

    {"c_linear": s/FLOP, "c_attention": s/FLOP, "micro_batch_overhead": s,
     "attention_half_tokens": tokens, "attention_call_overhead": s per document and layer,
     "iteration_overhead": s (optimizer step, gradient reduction),
     "comm_sizes_bytes": [...], "comm_seconds": [...], "bytes_per_element": 2,
     "calibration": {...}}

(``benchmarks/calibrate_training_cpu.py --json FILE`` writes such a file for a machine,
``benchmarks/calibrate_gpu.py --cost-model-config FILE`` for a GPU; ``calibration`` records
where the numbers come from -- date, GPU, torch version -- and is not read).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np

from skrull_ext.costmodel.model import CommModel, CostModel, ModelSpec
from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.scheduler.plan import Plan
from skrull_ext.attention.choice import runs_subgroups
from skrull_ext.costmodel.online import FEATURES, OnlineRefit
from skrull_ext.scheduler import SchedulerConfig, predict, schedule

from megatron.skrull.arguments import RunConfig
from megatron.skrull.cpu_compat import resolve_device

_TIME_KEYS = ("c_linear", "c_attention", "micro_batch_overhead", "attention_half_tokens",
              "attention_call_overhead", "iteration_overhead")
_CONFIG_KEYS = set(_TIME_KEYS) | {"comm_sizes_bytes", "comm_seconds", "bytes_per_element",
                                   "calibration"}


def model_spec(cfg: RunConfig, vocab_size: int) -> ModelSpec:
    """The cost model's view of the run's transformer."""
    m = cfg.model
    return ModelSpec(name="run", num_layers=m.num_layers, hidden_size=m.hidden_size,
                     ffn_hidden_size=m.ffn_size, num_attention_heads=m.num_attention_heads,
                     num_query_groups=m.query_groups, vocab_size=vocab_size, swiglu=m.swiglu,
                     tied_embeddings=not m.untie_embeddings_and_output_weights)


def _apply_config(cost: CostModel, path: str) -> CostModel:
    """``cost`` with the values of the JSON file ``path`` replacing its own."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"--skrull-cost-model-config {path}: expected a JSON object with "
                         f"keys among {sorted(_CONFIG_KEYS)}")
    unknown = sorted(set(obj) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"--skrull-cost-model-config {path}: unknown keys {unknown}; "
                         f"allowed: {sorted(_CONFIG_KEYS)}")
    try:
        time = dataclasses.replace(cost.time, **{k: float(obj[k]) for k in _TIME_KEYS
                                                 if k in obj})
        comm = cost.comm
        if "comm_sizes_bytes" in obj or "comm_seconds" in obj:
            comm = CommModel(sizes_bytes=tuple(obj["comm_sizes_bytes"]),
                             seconds=tuple(obj["comm_seconds"]))
        width = int(obj.get("bytes_per_element", cost.bytes_per_element))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--skrull-cost-model-config {path}: {exc} (comm_sizes_bytes and "
                         "comm_seconds go together; values must be numbers >= 0)") from exc
    if width < 1:
        raise ValueError(f"--skrull-cost-model-config {path}: bytes_per_element must be >= 1")
    return dataclasses.replace(cost, time=time, comm=comm, bytes_per_element=width)


def build_cost_model(cfg: RunConfig, vocab_size: int) -> CostModel:
    """Cost model for ``--skrull-hardware`` and ``--skrull-cost-model-config``.

    The preset's :meth:`~skrull_ext.costmodel.hardware.Hardware.cost_model` for the run's model, CP
    and DP sizes, per TP group (:meth:`~skrull_ext.costmodel.hardware.Hardware.with_tensor_parallel`); on the ``cpu`` preset messages carry fp32 (``--fp64``: float64) activations.

    Raises:
        ValueError: The config file has unknown keys or invalid values.
    """
    hardware = cfg.skrull.hardware or ("h100" if resolve_device(cfg.device).type == "cuda"
                                       else "cpu")
    # Per rank of the plan, a TP group: TP-split compute, ring messages and gradients.
    hw = get_hardware(hardware).with_tensor_parallel(cfg.parallel.tensor_model_parallel_size)
    cost = hw.cost_model(model_spec(cfg, vocab_size), cfg.parallel.context_parallel_size,
                         cfg.parallel.dp_size)
    if hardware == "cpu":
        cost = dataclasses.replace(cost, bytes_per_element=8 if cfg.fp64 else 4)
    if cfg.skrull.cost_model_config:
        cost = _apply_config(cost, cfg.skrull.cost_model_config)
    return dataclasses.replace(cost, objective=cfg.skrull.objective)


class BatchScheduler:
    """``lengths -> Plan`` with ``--skrull-scheduler`` on DP x CP and the bucket.

    Deterministic: every rank calling it with the same lengths and the same
    :attr:`cost_model` gets the same plan.  With ``online=True``
    (``--skrull-online-cost-model``) :meth:`observe` refits the cost model to measured
    iteration times (:class:`skrull_ext.costmodel.online.OnlineRefit`); callers feed it
    the same numbers on every rank so plans stay identical.

    Attributes:
        config: The scheduler's configuration.
        cost_model: What the next plan is computed with (seed, then refits).
    """

    def __init__(self, config: SchedulerConfig, cost_model: CostModel, *, online: bool = False,
                 pipeline: bool = False):
        self.config, self.cost_model = config, cost_model
        self.refit = OnlineRefit(cost_model) if online else None
        self.pipeline = pipeline  # PP > 1: reorder micro-batches for the 1F1B bubble

    def __call__(self, lengths: np.ndarray, cost_model: Optional[CostModel] = None) -> Plan:
        """Plans one global batch (``cost_model``: a snapshot, default :attr:`cost_model`)."""
        cost = cost_model or self.cost_model
        plan = schedule(lengths, self.config, cost)
        if self.pipeline:
            plan = pipeline_order(plan, cost)
        return plan

    def term_seconds(self, plan: Plan) -> np.ndarray:
        """``[len(FEATURES)]`` predicted seconds of ``plan`` per seed term, then the seed's
        whole prediction without its fixed overhead (the refit's regressors)."""
        if self.refit is None:
            raise ValueError("term_seconds needs online=True")
        return np.array([predict(plan, self.refit.terms[name])["iteration_time"]
                         for name in FEATURES])

    def observe(self, plan: Plan, measured_seconds: float) -> Optional[float]:
        """Feeds one measured iteration to the online refit (no-op when off).

        Returns:
            The refitted model's prediction for ``plan`` (``None`` while warming up or off).
        """
        if self.refit is None:
            return None
        refitted = self.refit.observe(self.term_seconds(plan), measured_seconds)
        if refitted is None:
            return None
        self.cost_model = refitted
        return float(predict(plan, refitted)["iteration_time"])


def make_batch_scheduler(cfg: RunConfig, vocab_size: int,
                         cost_model: Optional[CostModel] = None) -> BatchScheduler:
    """The run's :class:`BatchScheduler` (``--skrull-online-cost-model`` turns refits on)."""
    config = SchedulerConfig(dp_size=cfg.parallel.dp_size,
                             cp_size=cfg.parallel.context_parallel_size,
                             bucket_size=cfg.skrull.bucket_size, policy=cfg.skrull.scheduler,
                             plan_budget_ms=cfg.skrull.plan_budget_ms,
                             subgroups=runs_subgroups(cfg.skrull.attention_kernel,
                                                      resolve_device(cfg.device)))
    cost = cost_model or build_cost_model(cfg, vocab_size)
    return BatchScheduler(config, cost, online=online_refit(cfg),
                          pipeline=cfg.parallel.pipeline_model_parallel_size > 1)


def online_refit(cfg: RunConfig) -> bool:
    """Whether the cost model is refitted online: ``--skrull-online-cost-model`` if given,
    else on for CUDA runs (on one H200 it predicted iterations within a median 2.4% from the
    ``h100`` preset, docs/gpu.md) and off on CPU, where timings are noisy and tests compare
    plans across runs."""
    if cfg.skrull.online_cost_model is not None:
        return cfg.skrull.online_cost_model
    return resolve_device(cfg.device).type == "cuda"


def pipeline_order(plan: Plan, cost, order: str = "small-ends") -> Plan:
    """``plan`` with each DP rank's micro-batches in the feed order that shrinks the bubble.

    A micro-batch's time is the scheduler's own prediction of it (its slowest CP rank:
    local compute, distributed shares, the ring's exposed communication and CP sub-group
    rings, plus the per-micro-batch overhead), taken from ``plan.predicted`` when the
    scheduler filled it, else from :func:`~skrull_ext.scheduler.predict` under ``cost``;
    ``small-ends`` (shortest first, second shortest last) is usually the fastest order in
    the 1F1B simulation (``benchmarks/pp_table.py``).  ``predicted["micro_batch_times"]``
    is permuted alike, so it still lists the micro-batches in feed order.  Deterministic,
    so every rank reorders alike.
    """
    from skrull_ext.planner.pipeline import order_micro_batches

    times = plan.predicted.get("micro_batch_times")
    if times is None or [len(t) for t in times] != [len(m) for m in plan.dp_ranks]:
        times = predict(plan, cost)["micro_batch_times"]
    perms = [order_micro_batches(t, order).tolist() for t in times]
    ranks = tuple(tuple(mbs[i] for i in p) for mbs, p in zip(plan.dp_ranks, perms))
    predicted = dict(plan.predicted)
    if "micro_batch_times" in predicted:
        predicted["micro_batch_times"] = [[float(t[i]) for i in p]
                                          for t, p in zip(times, perms)]
    return dataclasses.replace(plan, dp_ranks=ranks, predicted=predicted)


def predicted_seconds(plan: Plan) -> Optional[float]:
    """The scheduler's predicted iteration time in seconds, if it recorded one."""
    value = plan.predicted.get("iteration_time")
    return float(value) if isinstance(value, (int, float)) else None
