"""``python -m skrull_ext.plan``: schedule one global batch and print / save the plan.

The stable contract other tools use::

    python -m skrull_ext.plan --lengths batch.json --dp-size 4 --cp-size 8 \\
        --bucket-size 26000 [--policy skrull] [--model qwen2.5-0.5b] [--json plan.json]

Bad input exits with code 2 and one ``error:`` line that names the fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

import numpy as np

import skrull_ext
from skrull_ext.cli_common import (Progress, check_bucket, check_layout, check_sample_count,
                                   count, name_flags, report_unexpected)
from skrull_ext.costmodel.model import MODEL_PRESETS, CostModel, default_cost_model, get_model_spec
from skrull_ext.planner.lengths_io import read_lengths
from skrull_ext.scheduler.plan import Plan
from skrull_ext.scheduler import POLICIES, ScheduleInputError, SchedulerConfig, schedule
from skrull_ext.scheduler.refine import DEFAULT_BUDGET_MS, budget_ms_arg


PROG = "python -m skrull_ext.plan"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints usage too)
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", required=True,
                   help="sample lengths: JSON list, .npy int array, or one int per line")
    p.add_argument("--dp-size", type=count, required=True, help="data-parallel degree D")
    p.add_argument("--cp-size", type=count, required=True, help="context-parallel degree N")
    p.add_argument("--bucket-size", type=count, required=True,
                   help="max tokens per CP rank (C)")
    p.add_argument("--policy", choices=POLICIES, default="skrull")
    p.add_argument("--rollback", choices=("shortest", "best-fit", "auto"), default="auto",
                   help="DACP roll-back victim choice")
    p.add_argument("--objective", choices=("paper", "ring"), default="ring",
                   help="micro-batch time: paper (docs/design.md section 3) or ring (ours, step by "
                        "step as the ring runs)")
    p.add_argument("--plan-budget-ms", type=budget_ms_arg, default=DEFAULT_BUDGET_MS,
                   help="local-search refinement budget (a fixed work count: the same plan "
                        "for the same budget; 0 turns it off)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", choices=sorted(MODEL_PRESETS), default="qwen2.5-0.5b",
                       help="cost-model preset")
    group.add_argument("--model-config", help="JSON ModelSpec for the cost model")
    p.add_argument("--json", dest="json_out", help="write the plan as JSON here")
    p.add_argument("--quiet", action="store_true", help="print only the overall summary")
    return p


def _summary(plan: Plan, baselines: dict[str, float], quiet: bool) -> str:
    pred = plan.predicted
    lines = [f"policy {plan.policy}  backend {skrull_ext.BACKEND}  samples {len(plan.lengths)}  "
             f"DP {plan.dp_size} x CP {plan.cp_size}  bucket {plan.bucket_size}  "
             f"micro-batches {plan.num_micro_batches}"]
    if not quiet:
        tokens = plan.rank_tokens()
        for d, mbs in enumerate(plan.dp_ranks):
            lines.append(f"dp {d}: predicted {pred['dp_rank_times'][d] * 1e3:.2f} ms")
            for m, mb in enumerate(mbs):
                n_local = sum(len(r) for r in mb.local)
                lines.append(
                    f"  mb {m}: tokens/cp-rank {tokens[d, m].tolist()}  local {n_local}  "
                    f"distributed {len(mb.distributed)}"
                    + (f"  grouped {len(mb.grouped)}" if mb.grouped else "")
                    + f"  predicted {pred['micro_batch_times'][d][m] * 1e3:.2f} ms")
    rank_times = np.asarray(pred["dp_rank_times"])
    imbalance = rank_times.max() / rank_times.mean() if rank_times.mean() > 0 else 1.0
    lines.append(f"iteration {pred['iteration_time'] * 1e3:.2f} ms  lower bound "
                 f"{pred['lower_bound'] * 1e3:.2f} ms  DP imbalance (max/mean) {imbalance:.3f}  "
                 f"tokens kept local {100 * plan.local_token_share():.1f}%")
    for name, t in baselines.items():
        lines.append(f"predicted speedup over {name}: {t / pred['iteration_time']:.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_layout(args.dp_size, args.cp_size)
    check_bucket(args.bucket_size)
    lengths = read_lengths(args.lengths)
    check_sample_count(len(lengths), f"--lengths {args.lengths}")
    with Progress(PROG, f"planning {len(lengths)} sequences on DP {args.dp_size} x CP "
                        f"{args.cp_size} (skrull and 2 baselines)"):
        plan, baselines = _plan(args, lengths)
    out = plan.to_json()
    out["predicted"]["speedup"] = {k: v / plan.predicted["iteration_time"]
                                   for k, v in baselines.items()}
    out["predicted"]["local_token_share"] = plan.local_token_share()
    out["config"]["backend"] = skrull_ext.BACKEND
    out["config"]["rollback"] = args.rollback
    out["config"]["objective"] = args.objective
    out["config"]["model"] = args.model_spec.name
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f)
    print(_summary(plan, baselines, args.quiet))
    return 0


def _plan(args: argparse.Namespace, lengths: np.ndarray) -> tuple[Plan, dict[str, float]]:
    """The requested policy's plan and the baselines' predicted iteration times."""
    spec = get_model_spec(args.model_config) if args.model_config else get_model_spec(args.model)
    args.model_spec = spec
    cost: CostModel = dataclasses.replace(default_cost_model(spec), objective=args.objective)
    cfg = SchedulerConfig(dp_size=args.dp_size, cp_size=args.cp_size,
                          bucket_size=args.bucket_size, policy=args.policy,
                          rollback=args.rollback, plan_budget_ms=args.plan_budget_ms)
    plan = schedule(lengths, cfg, cost)
    baselines = {}
    for name in ("all-cp", "per-seq-cp"):
        if name != args.policy:
            other = schedule(lengths, dataclasses.replace(cfg, policy=name, rollback="auto"),
                             cost)
            baselines[name] = other.predicted["iteration_time"]
    return plan, baselines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns 0, 2 (bad input: one ``error:`` line) or 1 (unexpected)."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ScheduleInputError, ValueError, OSError) as exc:  # SizeError is a ValueError
        print(f"error: {name_flags(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        return report_unexpected(PROG, exc)


if __name__ == "__main__":
    sys.exit(main())
