"""``skrull-plan`` / ``python -m skrull_ext.planner.cli``: plan a Skrull run before launching it.

Given a length distribution (a bundled profile, a lengths file or a Megatron dataset), a
model and a parallel layout, it recommends a bucket size from a memory estimate, samples
global batches, schedules them with Skrull and the baselines, simulates every plan on a
hardware preset and prints the predicted speedups; ``--plot`` draws a figure.  Every
impossible setting exits with status 2 and one line naming the flag to change.

Example::

    skrull-plan --profile chatqa2-long-sft --model qwen2.5-0.5b --dp-size 4 --cp-size 8 \\
        --global-batch-size 256 --hardware h100 --device-memory-gb 80 --plot plan.png
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from skrull_ext.cli_common import (MAX_RANKS, Progress, SizeError, check_bucket, check_layout,
                                   check_sample_count, count, name_flags, report_unexpected)
from skrull_ext.costmodel.memory import TrainingMemory
from skrull_ext.costmodel.model import MODEL_PRESETS, MemoryModel, ModelSpec, get_model_spec
from skrull_ext.planner.evaluate import compare_policies, fastest_bucket, max_fitting_length
from skrull_ext.planner.pipeline import ORDERS, check_pipeline, pipeline_bucket
from skrull_ext.costmodel.hardware import HARDWARE_PRESETS, Hardware, get_hardware
from skrull_ext.planner.profiles import (OVERFLOW_POLICIES, LengthProfile, load_profile,
                                 profile_from_file, profile_from_megatron, profile_names,
                                 sample_global_batches)
from skrull_ext.scheduler import DEFAULT_POLICIES, POLICIES, SchedulerConfig
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS, budget_ms_arg

GIB = float(1 << 30)
DEFAULT_DEVICE_GB = {"h100": 80.0, "cpu": 16.0}


PROG = "skrull-plan"


class PlannerError(Exception):
    """An impossible or inconsistent setting; the message names the flag to change."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too by default)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help=f"bundled length profile: {', '.join(profile_names())}")
    src.add_argument("--lengths", metavar="FILE",
                     help="your lengths: JSON list, .npy int array, or one integer per line")
    src.add_argument("--data-path", metavar="PREFIX",
                     help="Megatron indexed dataset prefix (reads PREFIX.idx)")
    mdl = p.add_mutually_exclusive_group()
    mdl.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b")
    mdl.add_argument("--model-config", metavar="FILE", help="JSON with ModelSpec fields")
    p.add_argument("--dp-size", type=count, default=1)
    p.add_argument("--cp-size", type=count, default=None,
                   help="--context-parallel-size (default: the smallest power of two that "
                        "fits the longest sequence)")
    p.add_argument("--tp-size", "--tensor-model-parallel-size", dest="tp_size", type=count,
                   default=1, help="tensor-parallel size: devices per rank of the plan "
                                   "(inside a node)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (with --tp-size > 1): layer "
                        "activations split over the TP ranks")
    p.add_argument("--pp-size", type=count, default=1,
                   help="--pipeline-model-parallel-size: 1F1B stages per DP x CP replica")
    p.add_argument("--pp-order", choices=ORDERS + ("best",), default="best",
                   help="order micro-batches enter the pipeline (best: fastest simulated)")
    p.add_argument("--global-batch-size", type=count, default=None,
                   help="sequences per global batch (default 64 x --dp-size)")
    p.add_argument("--hardware", choices=sorted(HARDWARE_PRESETS), default="h100")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="device memory in GiB (default: 80 for h100, 16 for cpu)")
    p.add_argument("--memory-margin-gb", type=float, default=None,
                   help="memory kept free, GiB (default 10%% of --device-memory-gb)")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="bf16 training (default on h100)")
    prec.add_argument("--fp16", action="store_true", help="fp16 training")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: fp32 main params and Adam state "
                        "sharded over DP x CP")
    p.add_argument("--recompute-granularity", choices=("selective", "full"), default=None,
                   help="activation recompute (default none)")
    p.add_argument("--activation-bytes-per-token", type=float, default=None,
                   help="override the model-based activation estimate (alpha)")
    p.add_argument("--bucket-size", type=count, default=None,
                   help="tokens per CP rank per micro-batch (default: from the memory model)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every length by this (e.g. 0.01 for CPU-sized runs)")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="error",
                   help="sequences longer than what fits: error (default), truncate, redraw")
    p.add_argument("--num-batches", type=count, default=20)
    p.add_argument("--seed", type=int, default=0)
    extras = ", ".join(p for p in POLICIES if p not in DEFAULT_POLICIES)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policies to compare (skrull is always included; "
                        f"default all but {extras}, which need pip install "
                        "'skrull-megatron[bench]')")
    p.add_argument("--backend", choices=("cpp", "python"), default=None)
    p.add_argument("--objective", choices=("paper", "ring"), default="ring",
                   help="the scheduler's micro-batch objective: paper (docs/design.md section 3) or "
                        "ring (ours, step by step as the ring runs)")
    p.add_argument("--plan-budget-ms", type=budget_ms_arg, default=None,
                   help="skrull's local-search refinement budget per batch (a fixed work "
                        f"count; default {DEFAULT_BUDGET_MS} ms; 0 turns it off)")
    p.add_argument("--plot", metavar="FILE.png", help="write the figure here")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON here")
    return p


def _profile(args) -> LengthProfile:
    try:
        if args.profile:
            prof = load_profile(args.profile)
        elif args.lengths:
            prof = profile_from_file(args.lengths)
        else:
            prof = profile_from_megatron(args.data_path)
        return prof.scaled(args.scale)
    except ValueError as exc:
        flag = ("--scale" if "--scale" in str(exc) else "--profile" if args.profile
                else "--lengths" if args.lengths else "--data-path")
        msg = str(exc)
        raise PlannerError(msg if flag in msg else f"{msg} ({flag})") from None


def _model(args) -> ModelSpec:
    try:
        return get_model_spec(args.model_config) if args.model_config else MODEL_PRESETS[args.model]
    except (OSError, ValueError) as exc:
        raise PlannerError(f"--model-config: {exc}") from None


def _hardware(args, model: ModelSpec) -> Hardware:
    """The ``--hardware`` preset for ``--tp-size`` devices per rank (checked against the
    model: Megatron splits attention heads and KV groups over the TP ranks)."""
    tp = args.tp_size
    if tp > 1 and (model.num_attention_heads % tp or model.num_query_groups % tp):
        raise PlannerError(f"--tp-size {tp} must divide the model's {model.num_attention_heads} "
                           f"attention heads and {model.num_query_groups} KV groups")
    if args.sequence_parallel and tp == 1:
        raise PlannerError("--sequence-parallel needs --tp-size > 1 (Megatron turns it off at "
                           "TP 1)")
    try:
        return get_hardware(args.hardware).with_tensor_parallel(tp)
    except ValueError as exc:
        raise PlannerError(f"--tp-size: {exc}") from None


def _check_sizes(args):
    try:
        check_layout(args.dp_size, 1 if args.cp_size is None else args.cp_size)
        for flag, value in (("--global-batch-size", args.global_batch_size),
                            ("--num-batches", args.num_batches)):
            if value < 1:
                raise PlannerError(f"{flag} must be >= 1, got {value}")
        check_sample_count(args.global_batch_size * args.num_batches,
                           f"--global-batch-size {args.global_batch_size} x --num-batches "
                           f"{args.num_batches}")
        if args.bucket_size is not None:
            check_bucket(args.bucket_size)
    except SizeError as exc:
        raise PlannerError(str(exc)) from None
    if args.activation_bytes_per_token is not None and args.activation_bytes_per_token <= 0:
        raise PlannerError("--activation-bytes-per-token must be > 0")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise PlannerError(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    return ["skrull"] + [p for p in policies if p != "skrull"]


def training_memory(hw: Hardware, dp_size: int, cp_size: int, *, precision: Optional[str] = None,
                    distributed_optimizer: bool = True,
                    recompute: Optional[str] = "selective",
                    sequence_parallel: bool = False) -> TrainingMemory:
    """The launcher's memory setup; defaults: the paper's (distributed optimizer, selective
    recompute) in the preset's precision (h100: bf16, cpu: fp32); TP from ``hw``
    (:meth:`Hardware.with_tensor_parallel`)."""
    tp = hw.tensor_parallel
    return TrainingMemory(precision=precision or ("bf16" if hw.activation_bytes == 2 else "fp32"),
                          distributed_optimizer=distributed_optimizer,
                          dp_cp_size=dp_size * cp_size, recompute=recompute, tp_size=tp,
                          sequence_parallel=sequence_parallel and tp > 1)


def _training_from_args(args, hw: Hardware) -> TrainingMemory:
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    return training_memory(hw, args.dp_size, args.cp_size, precision=precision,
                           distributed_optimizer=args.use_distributed_optimizer,
                           recompute=args.recompute_granularity,
                           sequence_parallel=args.sequence_parallel)


def memory_bucket(model: ModelSpec, hw: Hardware, dp_size: int, cp_size: int,
                  device_gb: Optional[float] = None, margin_gb: Optional[float] = None,
                  alpha: Optional[float] = None,
                  training: Optional[TrainingMemory] = None) -> int:
    """Largest bucket the memory model allows (raises ``ValueError`` when none does).

    Args:
        model, hw: Model shape and hardware preset.
        dp_size, cp_size: ``D`` and ``N`` (the optimizer state is sharded over both).
        device_gb: Device memory in GiB (default :data:`DEFAULT_DEVICE_GB`).
        margin_gb: Memory kept free in GiB (default 10% of the device).
        alpha: Activation bytes per token (default the memory model's).
        training: Precision, optimizer sharding, recompute (default
            :func:`training_memory`: the paper's setting).
    """
    device_gb = device_gb or DEFAULT_DEVICE_GB[hw.name]
    margin_gb = 0.1 * device_gb if margin_gb is None else margin_gb
    training = training or training_memory(hw, dp_size, cp_size)
    static = training.static_bytes(model)
    alpha = alpha or training.activation_bytes_per_token(model)
    return MemoryModel(alpha=alpha).bucket_size(device_gb * GIB, static, margin_gb * GIB)


def recommend_bucket(model: ModelSpec, hw: Hardware, dp_size: int, cp_size: int,
                     **memory) -> int:
    """The bucket the planner recommends (``memory``: :func:`memory_bucket` overrides)."""
    return memory_bucket(model, hw, dp_size, cp_size, **memory)


def memory_plan(args, model: ModelSpec, hw: Hardware) -> dict:
    """Bucket size from the memory model (or ``--bucket-size``), with the numbers behind it."""
    device_gb = args.device_memory_gb or DEFAULT_DEVICE_GB[hw.name]
    if device_gb <= 0:
        raise PlannerError(f"--device-memory-gb must be > 0, got {device_gb}")
    margin_gb = 0.1 * device_gb if args.memory_margin_gb is None else args.memory_margin_gb
    training = _training_from_args(args, hw)
    static = training.static_bytes(model)
    alpha = args.activation_bytes_per_token or training.activation_bytes_per_token(model)
    info = {"device_gib": device_gb, "margin_gib": margin_gb, "static_gib": static / GIB,
            "activation_bytes_per_token": alpha, "recommended_bucket": None,
            "training": {"precision": training.precision, "tp_size": training.tp_size,
                         "sequence_parallel": training.sequence_parallel,
                         "distributed_optimizer": training.distributed_optimizer,
                         "recompute": training.recompute},
            "static_breakdown_gib": {k: v / GIB for k, v in
                                     training.static_breakdown(model).items()}}
    try:
        if args.pp_size > 1:
            info.update(_pipeline_memory(args, model, hw, device_gb, margin_gb,
                                         static / model.param_count(), alpha))
        else:
            info["recommended_bucket"] = MemoryModel(alpha=alpha).bucket_size(
                device_gb * GIB, static, margin_gb * GIB)
    except ValueError as exc:
        if args.bucket_size is None:
            raise PlannerError(f"{exc}; or pass --use-distributed-optimizer / "
                               "--recompute-granularity full, raise --device-memory-gb, lower "
                               "--memory-margin-gb, or give --bucket-size") from None
    info["bucket"] = args.bucket_size or info["recommended_bucket"]
    if args.cp_size > 1 and info["bucket"] < 2 * args.cp_size:
        raise PlannerError(f"bucket size {info['bucket']} < 2 x --cp-size ({2 * args.cp_size}): "
                           "raise --bucket-size/--device-memory-gb or lower --cp-size")
    return info


def _pipeline_memory(args, model: ModelSpec, hw: Hardware, device_gb: float,
                     margin_gb: float, static_per_param: float, alpha: float) -> dict:
    """The 1F1B bucket: every stage's in-flight micro-batches within its memory (the
    training memory model's bytes per parameter and per token, split by stage)."""
    try:
        check_pipeline(model, args.pp_size)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None
    bucket, info = pipeline_bucket(
        model, hw, pp_size=args.pp_size, optimizer_shards=args.dp_size * args.cp_size,
        device_bytes=device_gb * GIB, margin_bytes=margin_gb * GIB, alpha=alpha,
        static_bytes_per_param=static_per_param)
    if bucket < 1:
        raise ValueError("no room for activations on some pipeline stage")
    stage0 = info["stages"][0]
    return {"recommended_bucket": bucket, "static_gib": stage0["static_bytes"] / GIB,
            "activation_bytes_per_token": stage0["bytes_per_token"], "pipeline": info}


def best_pipeline_bucket(args, batches, model, hw, mem: dict) -> dict:
    """Simulated skrull time at the memory bucket and at 1/2, 1/4 of it (more, smaller
    micro-batches shrink the pipeline bubble); returns ``{bucket: seconds}``."""
    longest = max(int(b.max()) for b in batches)
    out = {}
    for k in range(3):
        bucket = mem["recommended_bucket"] >> k
        if bucket < 2 * args.cp_size or max_fitting_length(args.cp_size, bucket) < longest:
            break
        comp = compare_policies(batches, model, hw, dp_size=args.dp_size,
                                cp_size=args.cp_size, bucket_size=bucket, policies=("skrull",),
                                backend=args.backend, objective=args.objective,
                                pp_size=args.pp_size, pp_order=args.pp_order)
        out[bucket] = comp.stats["skrull"].mean_time
    return out


def sample(args, prof: LengthProfile, limit: int, bucket: int):
    """Samples the global batches; enforces ``--overflow``."""
    if args.overflow == "error" and prof.max_length > limit:
        raise PlannerError(
            f"the longest sequence ({prof.max_length} tokens) cannot fit even when fully "
            f"distributed: --cp-size {args.cp_size} x bucket {bucket} "
            f"holds at most {limit} tokens; raise --cp-size or --bucket-size/"
            "--device-memory-gb, or pass --overflow truncate|redraw")
    try:
        return sample_global_batches(prof, num_batches=args.num_batches,
                                     global_batch_size=args.global_batch_size, seed=args.seed,
                                     max_length=limit, overflow=args.overflow)
    except ValueError as exc:  # e.g. redraw with nothing below the limit
        raise PlannerError(f"{exc} (--overflow / --scale)") from None


def summarize(comp, sampled, mem: dict, limit: int) -> dict:
    sk = comp.stats["skrull"]
    return {
        "bucket_size": mem["bucket"], "memory": mem, "longest_that_fits": limit,
        "overflow": {"policy": sampled.policy, "count": sampled.overflow},
        "skrull": {"mean_iteration_s": sk.mean_time,
                   "local_token_share": float(sk.local_shares.mean()),
                   "micro_batches_per_dp_rank": float(sk.micro_batches.mean()),
                   "lower_bound_s": float(sk.lower_bounds.mean()),
                   "ratio_to_bound": sk.ratio_to_bound},
        "policies": {p: {"mean_iteration_s": st.mean_time, "skrull_speedup": comp.speedup(p),
                         "ratio_to_bound": st.ratio_to_bound,
                         "micro_batches_per_dp_rank": float(st.micro_batches.mean()),
                         "padding_share": float(st.padding_shares.mean())}
                     for p, st in comp.stats.items()},
    }


def print_report(args, prof, model, hw, summary, out=None):
    mem = summary["memory"]
    out = out or sys.stdout
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(f"profile   {prof.summary()}")
    w(f"          source: {prof.source}")
    w(f"model     {model.name}: {model.param_count() / 1e9:.3f}B parameters, "
      f"{model.num_layers} layers, h={model.hidden_size}, h_kv={model.kv_hidden_size}")
    w(f"hardware  {hw.name}: {hw.description}")
    w(f"layout    TP={args.tp_size} DP={args.dp_size} CP={args.cp_size} PP={args.pp_size}"
      f"{' (smallest power of two that fits; --cp-size to choose)' if args.cp_auto else ''}, "
      f"global batch {args.global_batch_size}, {args.num_batches} sampled batches "
      f"(seed {args.seed})")
    rec = mem["recommended_bucket"]
    t, parts = mem["training"], mem["static_breakdown_gib"]
    w(f"training  {t['precision']}, distributed optimizer "
      f"{'on (sharded over DP x CP = ' + str(args.dp_size * args.cp_size) + ')' if t['distributed_optimizer'] else 'off'}"
      f", recompute {t['recompute'] or 'none'}"
      + (f", TP {t['tp_size']}{' with' if t['sequence_parallel'] else ' without'} sequence "
         "parallelism" if t["tp_size"] > 1 else ""))
    w(f"memory    device {mem['device_gib']:.1f} GiB - static {mem['static_gib']:.2f} GiB "
      f"(params {parts['params']:.2f} + grads {parts['grads']:.2f} + main params "
      f"{parts['main_params']:.2f} + Adam {parts['optimizer_state']:.2f}) - margin "
      f"{mem['margin_gib']:.1f} GiB, {mem['activation_bytes_per_token'] / 2**20:.3f} MiB/token "
      + (f"x {args.pp_size} micro-batches in flight on stage 0 (1F1B) " if args.pp_size > 1
         else "") + f"-> recommended bucket {rec if rec is not None else 'none'} tokens")
    for bucket, sec in mem.get("bucket_sweep", {}).items():
        w(f"pipeline  bucket {bucket:>8}: skrull iteration {sec * 1e3:.1f} ms"
          + ("  <- best" if bucket == summary["bucket_size"] else ""))
    if mem.get("bucket_choice"):
        tried = ", ".join(f"{c}: {s * 1e3:.1f} ms" for c, s in mem["bucket_choice"].items())
        w(f"          bucket chosen for the lowest predicted Skrull iteration within memory "
          f"({tried})")
    w(f"bucket    {summary['bucket_size']} tokens per CP rank per micro-batch"
      f"{' (--bucket-size)' if args.bucket_size else ''}; longest sequence that fits "
      f"{summary['longest_that_fits']}")
    ov = summary["overflow"]
    if ov["count"]:
        w(f"overflow  {ov['count']} sampled sequences were longer than that ({ov['policy']})")
    sk = summary["skrull"]
    w(f"skrull    {sk['micro_batches_per_dp_rank']:.1f} micro-batches per DP rank, "
      f"{100 * sk['local_token_share']:.1f}% of tokens kept local, iteration "
      f"{sk['mean_iteration_s'] * 1e3:.1f} ms (lower bound {sk['lower_bound_s'] * 1e3:.1f} ms, "
      f"x{sk['ratio_to_bound']:.2f})")
    w()
    w(f"{'policy':12} {'iteration ms':>12} {'skrull speedup':>14} {'/ bound':>8} "
      f"{'micro-batches':>13} {'padding %':>9}")
    for p, st in summary["policies"].items():
        w(f"{p:12} {st['mean_iteration_s'] * 1e3:12.1f} {st['skrull_speedup']:13.2f}x "
          f"{st['ratio_to_bound']:8.2f} {st['micro_batches_per_dp_rank']:13.1f} "
          f"{100 * st['padding_share']:9.2f}")


def run(args) -> dict:
    """Everything after parsing; raises :class:`PlannerError` on impossible settings."""
    if args.global_batch_size is None:
        args.global_batch_size = 64 * max(args.dp_size, 1)
    policies = _check_sizes(args)
    if not args.scale > 0:
        raise PlannerError(f"--scale must be > 0, got {args.scale}")
    model = _model(args)
    hw = _hardware(args, model)
    prof = _profile(args)
    args.cp_auto = args.cp_size is None
    if args.cp_auto:
        args.cp_size = auto_cp_size(args, prof, model, hw)
    mem = memory_plan(args, model, hw)
    limit = max_fitting_length(args.cp_size, mem["bucket"])
    sampled = sample(args, prof, limit, mem["bucket"])
    try:
        SchedulerConfig(dp_size=args.dp_size, cp_size=args.cp_size, bucket_size=mem["bucket"])
        if args.pp_size > 1 and args.bucket_size is None:  # simulated with the pipeline
            mem["bucket_sweep"] = best_pipeline_bucket(args, sampled.batches, model, hw, mem)
            mem["bucket"] = min(mem["bucket_sweep"], key=mem["bucket_sweep"].get)
            limit = max_fitting_length(args.cp_size, mem["bucket"])
        elif args.bucket_size is None:  # the fastest predicted bucket within the memory limit
            with Progress(PROG, f"choosing the bucket: {args.num_batches} batches of "
                                f"{args.global_batch_size} at fractions of the memory limit"):
                mem["bucket"], mem["bucket_choice"] = fastest_bucket(
                    sampled.batches, model, hw, dp_size=args.dp_size, cp_size=args.cp_size,
                    max_bucket=mem["bucket"], objective=args.objective, backend=args.backend)
        with Progress(PROG, f"scheduling and simulating {args.num_batches} batches of "
                            f"{args.global_batch_size} with {len(policies)} policies"):
            comp = compare_policies(sampled.batches, model, hw, dp_size=args.dp_size,
                                    cp_size=args.cp_size, bucket_size=mem["bucket"],
                                    policies=policies, backend=args.backend,
                                    objective=args.objective, pp_size=args.pp_size,
                                    pp_order=args.pp_order, plan_budget_ms=args.plan_budget_ms)
    except (ValueError, ImportError) as exc:
        raise PlannerError(name_flags(str(exc).splitlines()[0])) from None
    summary = summarize(comp, sampled, mem, limit)
    print_report(args, prof, model, hw, summary)
    if args.plot:
        from skrull_ext.planner.plotting import plot_planner

        title = (f"{prof.name} | {model.name} | DP={args.dp_size} CP={args.cp_size} "
                 f"PP={args.pp_size} | bucket "
                 f"{mem['bucket']} | {hw.name}")
        try:
            plot_planner(args.plot, sampled.batches, comp, comp.example_results["skrull"],
                         mem["bucket"], limit, title)
        except (OSError, ValueError) as exc:
            raise PlannerError(f"--plot {args.plot}: {exc}") from None
        print(f"\nfigure written to {args.plot}")
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
        except OSError as exc:
            raise PlannerError(f"--json {args.json}: {exc}") from None
    return summary


def auto_cp_size(args, prof: LengthProfile, model: ModelSpec, hw: Hardware) -> int:
    """The smallest power-of-two ``--cp-size`` whose bucket fits the longest sequence.

    Without it the default CP of 1 fits none of the bundled profiles (their longest
    sequences, 78K-1.6M tokens, exceed any single device's bucket).  With ``--overflow
    truncate|redraw`` and nothing fitting, CP 1.
    """
    cp = 1
    while args.dp_size * cp <= MAX_RANKS:
        args.cp_size = cp
        mem = memory_plan(args, model, hw)
        if prof.max_length <= max_fitting_length(cp, mem["bucket"]):
            return cp
        cp *= 2
    if args.overflow != "error":
        return 1
    raise PlannerError(f"the longest sequence ({prof.max_length} tokens) fits no --cp-size up "
                       f"to {cp // 2}; raise --bucket-size/--device-memory-gb or pass "
                       "--overflow truncate|redraw")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit status (0, 2 for bad settings, 1 unexpected)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except PlannerError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        return report_unexpected(PROG, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
