"""Megatron-LM's dynamic-CP benchmark in the planner's simulator: dp_balanced, dynamic CP, skrull.

Megatron-LM ``dev`` (d48bd6be) ``examples/dynamic_context_parallel/`` publishes GPU
measurements of ``--sequence-packing-scheduler dp_balanced`` against
``default_dynamic_cp`` (:data:`PUBLISHED`; 10% trimmed means of 20 iterations after 10 of
warm-up, four GPUs per node; :data:`PUBLISHED_MEAN` their arithmetic means).  Its authors
have since dropped these numbers: they came from the earlier dev stack and do not validate
the current code (pull request 5811, 2026-07-14, open: the port to main, one node only).  This reproduces its setting (:data:`MODEL`: the script's
defaults, 12 layers, hidden 2048, FFN 8192, 16 heads, vocabulary 131072, no SwiGLU, tied
embeddings; TP 1, CP 4, 8 micro-batches of one sample per DP rank, so GBS = 8 D;
``--max-seqlen-per-dp-cp-rank 2048``; lengths of its mock dataset: NumPy's legacy
``seed(0)`` lognormal with mean 1024, sigma 1.5, clipped to [128, 8192], minus the
next-token shift, in Megatron's DP-rank-major global order (:func:`global_batch`), each
padded to ``padded_seq_len`` (:func:`megatron_padded`)) and times every iteration with the
simulator:

* ``dp_balanced``: our re-implementation (``skrull_ext.scheduler.megatron_packing``), a plan
  over D replicas of 4 ranks;
* dynamic CP: Megatron's own rule over the D x 4 world (``dynamic_cp_world`` with one
  block), a plan over one "replica" of ``4 D`` ranks whose groups may span DP replicas,
  timed as Megatron runs it: a group starts a micro-batch when all its ranks finished
  their previous one (no barrier across groups; :func:`group_synced_time`);
* skrull: ``schedule()`` with the same cost model, D replicas of 4 ranks.

Time models: ``preset`` (the h100 preset, one NVLink domain for every GPU count, fp32
gradient reduction as Megatron does for bf16: nothing fitted); ``te-host`` and
``te-host-all-in``: the preset plus the host time of TE's THD p2p ring per ring step and
layer (:func:`te_ring_step_host_s`: counts and host time of TE's own code measured by
``benchmarks/te_ring_host.py``, per-call costs of the H200 machine; nothing fitted), added
to every step's compute (an upper bound of ``max(host, device)``); ``pcie4-ring``: the ring
on a PCIe 4.0 x16 link, and ``pcie4-nodes`` that with four GPUs per node (rings over more
ranks and the gradient all-reduce on the preset's inter-node link); and ``calibrated``: three
fixed costs (per iteration, per micro-batch, per ring step and layer) fitted by least
squares to the ten published absolute times (log errors), everything else as ``preset``.
``--spread`` reports the dynamic-CP / dp_balanced ratio over other 20-iteration windows of
the same stream (how much one run of 20 iterations varies).

    PYTHONPATH=. python benchmarks/megatron_dynamic_cp.py   # records benchmarks/results/megatron_dynamic_cp-<date>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

import results_io
from megatron.skrull import varlen_mock
from skrull_ext.costmodel.hardware import Hardware, get_hardware, linear_comm
from skrull_ext.costmodel.model import ModelSpec
from skrull_ext.planner.simulator import simulate
from skrull_ext.scheduler import SchedulerConfig, schedule
from skrull_ext.scheduler.megatron_packing import dynamic_cp_world, world_micro_batch
from skrull_ext.scheduler.plan import Plan

MODEL = ModelSpec(name="megatron-dcp-example", num_layers=12, hidden_size=2048,
                  ffn_hidden_size=8192, num_attention_heads=16, num_query_groups=16,
                  vocab_size=131072, swiglu=False, tied_embeddings=True)
CP, BUCKET, PER_RANK = 4, 2048, 8
# GPUs: (dp_balanced trimmed ms, dynamic CP trimmed ms), Megatron-LM dev README.
PUBLISHED = {4: (195.269, 151.906), 8: (220.119, 155.850), 16: (226.775, 187.125),
             32: (286.206, 208.088), 64: (271.988, 181.912)}
# The same runs' arithmetic means (ms): dynamic CP's exceed its trimmed means by 18-36 ms at
# 32-64 GPUs (the README puts that on spikes when dynamic groups are first used).
PUBLISHED_MEAN = {4: (216.125, 155.150), 8: (226.515, 157.905), 16: (231.620, 189.470),
                  32: (287.780, 225.875), 64: (281.480, 217.620)}
WARMUP, MEASURED = 10, 20
MEGATRON_LM = "dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
# TE v2.12's THD p2p ring at CP 4, per layer (forward + backward, mean of the CP ranks), from
# benchmarks/te_ring_host.py (TE_RING_RESULTS): host seconds of TE's Python on this CPU, CUDA
# kernels (its 76.75 aten kernels less 3 ``.item()`` reads and the 6 x 1.5 eager ops of the
# softmax-statistics merges that TE's torch.compile fuses to 1.5 kernels), stream waits
# (20 request waits, 3 event waits, 1 stream wait), event records, NCCL isend/irecv, syncs.
TE_RING_RESULTS = "benchmarks/results/te_ring_host-2026-11-26T090552Z.json"
TE_RING_CP4 = {"host_s": 629.6e-6, "kernels": 64.75, "waits": 24, "records": 3, "nccl": 14,
               "syncs": 3}
# Host seconds per call on the H200 machine (torch.profiler self CPU per call, one step of the
# launcher: benchmarks/results/profile_step-2026-11-26T0401Z.json): cudaLaunchKernel,
# cudaStreamWaitEvent, cudaEventRecord, cudaMemcpyAsync (a device-to-host read).
H200_CALL_S = {"launch": 6.64e-6, "wait": 1.83e-6, "record": 1.04e-6, "read": 10.23e-6}
# All-in host seconds per kernel of a host-bound step on that machine: the launcher's step,
# 132 ms without the profiler (docs/gpu.md) for 3,313 + 291 kernel launches (the profile).
ALL_IN_KERNEL_S = 132e-3 / (3313 + 291)
# The ring's link if the published machine's CP ranks talk over PCIe 4.0 x16 rather than
# NVLink (a hypothesis, not fitted: the README names no hardware; "four GPUs per node"):
# 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction, of which P2P copies reach ~80%;
# ~10 us per message as the preset's inter-node link.
PCIE4_P2P_BYTES_PER_S = 25e9
PCIE4_P2P_LATENCY_S = 10e-6
# GPUs per node of the published runs (the README's only word on the machine).
GPUS_PER_NODE = 4


# The example's --varlen-mock-dataset-config-json (its default).
MOCK = {"mode": "distribution", "type": "lognormal", "min_seq_len": 128, "max_seq_len": 8192,
        "mean_seq_len": 1024, "lognormal_sigma": 1.5}


def mock_lengths(count: int) -> np.ndarray:
    """The mock dataset's first ``count`` sample lengths after the shift (the launcher's
    ``--use-varlen-dataset --mock-data`` draw, :mod:`megatron.skrull.varlen_mock`)."""
    return varlen_mock.megatron_lengths(MOCK)[:count] - 1


def global_batch(pool: np.ndarray, iteration: int, dp_size: int) -> np.ndarray:
    """One iteration's ``PER_RANK x D`` lengths in Megatron's global order.

    ``MegatronPretrainingSampler`` (micro-batch size 1) gives DP rank ``r`` dataset sample
    ``base + m D + r`` at its ``m``-th fetch, and ``get_batch_and_global_seqlens``
    concatenates the ranks' fetches DP-rank-major: ``dp_balanced`` packs in this order.
    """
    base = iteration * PER_RANK * dp_size
    order = [base + m * dp_size + r for r in range(dp_size) for m in range(PER_RANK)]
    return pool[order]


def megatron_padded(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """``padded_seq_len``: ``MockVarlenDataset`` pads each sample to ``2 N`` tokens
    (``dp_balanced``) or ``2 D N`` (dynamic CP); the pad tokens run through the model."""
    return -(-lengths // multiple) * multiple


def trimmed_mean(values) -> float:
    """Megatron's script: drop ``int(0.1 n)`` from each end, average the rest."""
    v = sorted(values)
    k = int(len(v) * 0.1)
    return float(np.mean(v[k:len(v) - k] if len(v) - 2 * k > 0 else v))


def group_synced_time(plan: Plan, res) -> float:
    """Dynamic CP's iteration: per micro-batch each group (ranks sharing a ring, or one
    rank) starts when all its ranks finished their previous micro-batch."""
    n = plan.cp_size
    finish = np.zeros(n)
    busy = res.busy()[0]
    for j, mb in enumerate(plan.dp_ranks[0]):
        if mb.is_empty():
            continue
        sets = [[r] for r in range(n)] if not mb.distributed else [list(range(n))]
        for _, first, size in sorted({(0, f, g) for _, f, g in mb.grouped}):
            sets = [s for s in sets if not first <= s[0] < first + size] + \
                [list(range(first, first + size))]
        new = finish.copy()
        for ranks in sets:
            if any(busy[j, r] > 0 for r in ranks):
                t = max(finish[r] for r in ranks) + max(busy[j, r] for r in ranks)
                new[ranks] = t + res.overhead[0, j]
        finish = new
    return float(finish.max()) + res.iteration_time - res.compute_time


def preset_hardware() -> Hardware:
    """The h100 preset with every GPU in one NVLink domain and fp32 gradient reduction."""
    return dataclasses.replace(get_hardware("h100"), gpus_per_node=1 << 10, grad_bytes=4,
                               description="h100 preset, one NVLink domain, fp32 grads")


def te_ring_step_host_s(all_in: bool = False) -> float:
    """Host seconds of one step of TE's THD p2p ring per layer (forward + backward).

    ``all_in=False``: TE's Python measured on CPU tensors plus, per call, the H200 host cost
    of what a CPU run skips: a launch per kernel, the stream waits and event records, an
    NCCL call as a launch, a record and a wait, a device-to-host read per ``.item()``.
    ``all_in=True``: every kernel at the all-in host cost of a host-bound step of our
    launcher on that machine (Python, autograd and launch included).  At CP 4, per step.
    """
    r, c = TE_RING_CP4, H200_CALL_S
    nccl = r["nccl"] * (c["launch"] + c["record"] + c["wait"])
    if all_in:
        return (r["kernels"] * ALL_IN_KERNEL_S + nccl) / CP
    return (r["host_s"] + r["kernels"] * c["launch"] + r["waits"] * c["wait"]
            + r["records"] * c["record"] + nccl + r["syncs"] * c["read"]) / CP


def with_overheads(hw: Hardware, x) -> Hardware:
    """``hw`` with (per iteration ms, per micro-batch ms, per ring step and layer us)."""
    return dataclasses.replace(hw, step_overhead_s=x[0] * 1e-3, micro_batch_overhead_s=x[1] * 1e-3,
                               layer_overhead_s=0.0, ring_step_overhead_s=x[2] * 1e-6)


def baseline_plans(gpus: int, start: int, pool: np.ndarray) -> list:
    """``(dp_balanced plan, dynamic-CP world plan, lengths)`` of iterations from ``start``."""
    d = gpus // CP
    out = []
    for it in range(start, start + MEASURED):
        lengths = global_batch(pool, it, d)
        cfg = SchedulerConfig(dp_size=d, cp_size=CP, bucket_size=BUCKET, policy="dp-balanced")
        dpb = schedule(megatron_padded(lengths, 2 * CP), cfg,
                       preset_hardware().cost_model(MODEL, CP, d))
        padded = megatron_padded(lengths, 2 * CP * d)
        world = dynamic_cp_world(padded, d, CP, BUCKET, d * CP)
        dcp = Plan(lengths=padded, dp_size=1, cp_size=d * CP, bucket_size=BUCKET,
                   policy="dynamic-cp", dp_ranks=(tuple(world_micro_batch(g, d * CP)
                                                        for g in world),))
        dcp.validate()
        out.append((dpb, dcp, lengths))
    return out


def groups_first_used(pool: np.ndarray, gpus: int) -> list:
    """Dynamic CP's groups of two or more ranks first used in each measured iteration.

    Megatron builds every aligned group at start-up, but NCCL sets a communicator up on its
    first use: the README's spikes, which its trimmed mean is meant to drop.
    """
    d, seen, out = gpus // CP, set(), []
    for it in range(WARMUP + MEASURED):
        padded = megatron_padded(global_batch(pool, it, d), 2 * CP * d)
        new = {(first, size) for mb in dynamic_cp_world(padded, d, CP, BUCKET, d * CP)
               for first, size, _ in mb if size > 1} - seen
        seen |= new
        out.append(len(new))
    return out[WARMUP:]


def iteration_times(plans, hw: Hardware, with_skrull: bool = False) -> dict:
    """Every policy's simulated iteration times (s) over the plans on ``hw``."""
    got = {"dp_balanced": [], "dynamic_cp": [], "skrull": []}
    for dpb, dcp, lengths in plans:
        got["dp_balanced"].append(simulate(dpb, MODEL, hw).iteration_time)
        got["dynamic_cp"].append(group_synced_time(dcp, simulate(dcp, MODEL, hw)))
        if with_skrull:
            d = dpb.dp_size
            plan = schedule(lengths, SchedulerConfig(dp_size=d, cp_size=CP, bucket_size=BUCKET),
                            hw.cost_model(MODEL, CP, d))
            got["skrull"].append(simulate(plan, MODEL, hw).iteration_time)
    return {k: v for k, v in got.items() if v}


def times(plans, hw: Hardware, with_skrull: bool = False, stat=trimmed_mean) -> dict:
    """``stat`` (Megatron's trimmed mean by default) in ms of every policy's times."""
    return {k: 1e3 * stat(v) for k, v in iteration_times(plans, hw, with_skrull).items()}


def calibrate(plans_by_gpus: dict, hw: Hardware) -> tuple:
    """The three fixed costs fitted to the published times: ``(x, rms log error)``."""
    from scipy.optimize import least_squares

    def residuals(x):
        out = []
        for gpus, plans in plans_by_gpus.items():
            t = times(plans, with_overheads(hw, x))
            out += [math.log(t["dp_balanced"] / PUBLISHED[gpus][0]),
                    math.log(t["dynamic_cp"] / PUBLISHED[gpus][1])]
        return out

    fit = least_squares(residuals, x0=[50.0, 10.0, 500.0], bounds=([0, 0, 0], [1e3, 1e3, 1e4]),
                        diff_step=0.05)
    return [float(v) for v in fit.x], float(np.sqrt(np.mean(np.square(fit.fun))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=sorted(PUBLISHED))
    parser.add_argument("--spread", type=int, default=4,
                        help="other 20-iteration windows for the ratio's spread (0: none)")
    parser.add_argument("--no-calibration", action="store_true")
    parser.add_argument("--json", help="write the table and settings here")
    args = parser.parse_args(argv)
    run = results_io.start()
    pool = mock_lengths(PER_RANK * max(args.gpus) // CP * (WARMUP + MEASURED) * (1 + args.spread))
    plans = {g: baseline_plans(g, WARMUP, pool) for g in args.gpus}
    hw = preset_hardware()
    host = {name: te_ring_step_host_s(all_in) for name, all_in in
            (("te-host", False), ("te-host-all-in", True))}
    models = {"preset": hw} | {name: dataclasses.replace(hw, ring_step_overhead_s=s)
                               for name, s in host.items()}
    models["pcie4-ring"] = dataclasses.replace(
        hw, intra_node_comm=linear_comm(PCIE4_P2P_LATENCY_S, PCIE4_P2P_BYTES_PER_S))
    # and four GPUs per node (the README's): rings over more than four ranks and the
    # gradient all-reduce from 8 GPUs on take the preset's inter-node link
    models["pcie4-nodes"] = dataclasses.replace(models["pcie4-ring"], gpus_per_node=GPUS_PER_NODE)
    print(", ".join(f"{k}: {v * 1e6:.0f} us" for k, v in host.items()) +
          " of TE ring host time per ring step and layer")
    fitted = None
    if not args.no_calibration:
        fitted, rms = calibrate(plans, hw)
        models["calibrated"] = with_overheads(hw, fitted)
        print(f"calibrated: {fitted[0]:.2f} ms per iteration, {fitted[1]:.2f} ms per "
              f"micro-batch, {fitted[2]:.1f} us per ring step and layer (rms log error "
              f"{rms:.3f})")
    first_used = {g: groups_first_used(pool, g) for g in args.gpus}
    print("dynamic CP's groups first used in the measured iterations: " +
          ", ".join(f"{g} GPUs {sum(v)} in {sum(x > 0 for x in v)}" for g, v in first_used.items()))
    rows = []
    for name, h in models.items():
        for g in args.gpus:
            raw = iteration_times(plans[g], h, with_skrull=True)
            t = {k: 1e3 * trimmed_mean(v) for k, v in raw.items()}
            mean_ratio = float(np.mean(raw["dp_balanced"]) / np.mean(raw["dynamic_cp"]))
            spread = [times(baseline_plans(g, WARMUP + MEASURED * (1 + w), pool), h)
                      for w in range(args.spread)]
            ratios = [s["dp_balanced"] / s["dynamic_cp"] for s in spread]
            pub = PUBLISHED[g][0] / PUBLISHED[g][1]
            pub_mean = PUBLISHED_MEAN[g][0] / PUBLISHED_MEAN[g][1]
            row = {"model": name, "gpus": g, "published_ratio": pub, "ms": t,
                   "ratio": t["dp_balanced"] / t["dynamic_cp"],
                   "ratio_spread": [min(ratios), max(ratios)] if ratios else None,
                   "published_mean_ratio": pub_mean, "ratio_of_means": mean_ratio,
                   "dcp_groups_first_used": first_used[g],
                   "skrull_vs_dp_balanced": t["dp_balanced"] / t["skrull"],
                   "skrull_vs_dynamic_cp": t["dynamic_cp"] / t["skrull"]}
            rows.append(row)
            spread_s = f" [{min(ratios):.3f}-{max(ratios):.3f}]" if ratios else ""
            print(f"{name:14} {g:>3} GPUs: dp_balanced {t['dp_balanced']:7.1f} ms, dynamic CP "
                  f"{t['dynamic_cp']:7.1f}, skrull {t['skrull']:7.1f} | dyn-CP speedup "
                  f"{row['ratio']:.3f}{spread_s} (published {pub:.3f}, "
                  f"{row['ratio'] / pub - 1:+.1%}; of means {mean_ratio:.3f}, published "
                  f"{pub_mean:.3f}, {mean_ratio / pub_mean - 1:+.1%}) | skrull x{row['skrull_vs_dp_balanced']:.3f} "
                  f"over dp_balanced, x{row['skrull_vs_dynamic_cp']:.3f} over dynamic CP",
                  flush=True)
    extra = {"megatron_lm": MEGATRON_LM, "fitted": fitted, "te_ring_step_host_s": host,
             "te_ring_results": TE_RING_RESULTS}
    results_io.record("megatron_dynamic_cp", rows, run, argv, **extra)
    if args.json:  # an extra copy where asked
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": results_io.meta("megatron_dynamic_cp", run, argv) | extra,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
