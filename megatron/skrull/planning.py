"""The per-iteration planner: global-batch lengths -> :class:`skrull_ext.plan.Plan`.

Every rank calls the planner with the same lengths and gets the same plan (the scheduler
is deterministic), so no plan is ever broadcast.  The cost model comes from the run's
model shape and ``--skrull-hardware`` (``h100``: the paper's H100 NVLink numbers; ``cpu``:
rough defaults for this CPU/gloo stack; default: from the device), optionally overridden by
``--skrull-cost-model-config FILE``, a JSON object with any of::

    {"c_linear": s/FLOP, "c_attention": s/FLOP, "micro_batch_overhead": s,
     "comm_sizes_bytes": [...], "comm_seconds": [...], "bytes_per_element": 2}

(fit ``c_*`` with ``skrull_ext.cost.TimeModel.calibrate`` on measured step times).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

import numpy as np

from skrull_ext.cost import H100_NVLINK_COMM, CommModel, CostModel, ModelSpec, TimeModel
from skrull_ext.cost import h100_time_model
from skrull_ext.plan import Plan
from skrull_ext.scheduler import SchedulerConfig, schedule

from megatron.skrull.arguments import RunConfig
from megatron.skrull.cpu_compat import resolve_device

Planner = Callable[[np.ndarray], Plan]

# Rough CPU defaults (2-4 cores, fp32, gloo over loopback); calibrate for real numbers.
CPU_TIME_MODEL = TimeModel(c_linear=1.0 / 20e9, c_attention=1.0 / 10e9,
                           micro_batch_overhead=0.05)
CPU_GLOO_COMM = CommModel(sizes_bytes=(64 * 1024.0, 64 * 1024.0 * 1024.0),
                          seconds=(1e-4, 6.4e-2))
_CONFIG_KEYS = {"c_linear", "c_attention", "micro_batch_overhead", "comm_sizes_bytes",
                "comm_seconds", "bytes_per_element"}


def model_spec(cfg: RunConfig, vocab_size: int) -> ModelSpec:
    """The cost model's view of the run's transformer."""
    m = cfg.model
    return ModelSpec(name="run", num_layers=m.num_layers, hidden_size=m.hidden_size,
                     ffn_hidden_size=m.ffn_size, num_attention_heads=m.num_attention_heads,
                     num_query_groups=m.query_groups, vocab_size=vocab_size, swiglu=m.swiglu)


def build_cost_model(cfg: RunConfig, vocab_size: int) -> CostModel:
    """Cost model for ``--skrull-hardware`` and ``--skrull-cost-model-config``.

    Raises:
        ValueError: The config file has unknown keys or invalid values.
    """
    hardware = cfg.skrull.hardware or ("h100" if resolve_device(cfg.device).type == "cuda"
                                       else "cpu")
    if hardware == "h100":
        time, comm, width = h100_time_model(), H100_NVLINK_COMM, 2
    else:
        time, comm, width = CPU_TIME_MODEL, CPU_GLOO_COMM, 8 if cfg.fp64 else 4
    path = cfg.skrull.cost_model_config
    if path:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        unknown = sorted(set(obj) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(f"--skrull-cost-model-config {path}: unknown keys {unknown}; "
                             f"allowed: {sorted(_CONFIG_KEYS)}")
        time = dataclasses.replace(time, **{k: float(obj[k]) for k in
                                            ("c_linear", "c_attention", "micro_batch_overhead")
                                            if k in obj})
        if "comm_sizes_bytes" in obj or "comm_seconds" in obj:
            comm = CommModel(sizes_bytes=tuple(obj["comm_sizes_bytes"]),
                             seconds=tuple(obj["comm_seconds"]))
        width = int(obj.get("bytes_per_element", width))
    return CostModel(model=model_spec(cfg, vocab_size), time=time, comm=comm,
                     bytes_per_element=width)


def make_planner(cfg: RunConfig, vocab_size: int,
                 cost_model: Optional[CostModel] = None) -> Planner:
    """``lengths -> Plan`` with ``--skrull-scheduler`` on DP x CP and the bucket."""
    config = SchedulerConfig(dp_size=cfg.parallel.dp_size,
                             cp_size=cfg.parallel.context_parallel_size,
                             bucket_size=cfg.skrull.bucket_size, policy=cfg.skrull.scheduler)
    cost = cost_model or build_cost_model(cfg, vocab_size)
    return lambda lengths: schedule(lengths, config, cost)


def predicted_seconds(plan: Plan) -> Optional[float]:
    """The scheduler's predicted iteration time in seconds, if it recorded one."""
    value = plan.predicted.get("iteration_time")
    return float(value) if isinstance(value, (int, float)) else None
