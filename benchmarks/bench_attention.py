"""DACP attention: Skrull placement vs all-distributed, forward+backward on CPU (gloo).

One micro-batch: a long sequence (8K) plus short ones (200-1,500 tokens).  The Skrull
placement keeps the short sequences local (balanced over the CP ranks by tokens, largest
first) and distributes only the long one; the baseline distributes everything (plain
zigzag context parallelism).  Each iteration runs ``dacp_attention`` forward+backward on
every rank; an iteration's time is the slowest rank's.  Reports medians and the bytes
the ring sent (all ranks together, forward and backward).

Usage::

    PYTHONPATH=$PWD python benchmarks/bench_attention.py            # ~1 minute on 2 cores
    PYTHONPATH=$PWD python benchmarks/bench_attention.py --long 4096 --repeats 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import results_io
from skrull_ext.attention import RingComm, dacp_attention
from skrull_ext.attention.layout import build_rank_layout


def make_micro_batch(args):
    """Returns ``lengths`` and the two placements ``{name: (distributed, local)}``."""
    rng = np.random.default_rng(args.seed)
    short = rng.integers(args.short_min, args.short_max + 1, size=args.num_short).tolist()
    lengths = [args.long] + [int(x) for x in short]
    n = args.world
    local = [[] for _ in range(n)]
    load = [0] * n
    for s in sorted(range(1, len(lengths)), key=lambda i: -lengths[i]):  # largest first
        r = load.index(min(load))
        local[r].append(s)
        load[r] += lengths[s]
    return lengths, {
        "skrull (short local, 8K distributed)": ([0], local),
        "all distributed": (list(range(len(lengths))), [[] for _ in range(n)]),
    }


class _Case:
    """One placement on this rank: layout, inputs and a byte-counting communicator."""

    def __init__(self, rank, args, lengths, distributed, local):
        self.layout = build_rank_layout(lengths, distributed, local, rank, args.world)
        g = torch.Generator().manual_seed(1000 + rank)
        t, h, d = self.layout.num_tokens, args.heads, args.head_dim
        self.q, self.k, self.v = (torch.randn(t, h, d, generator=g).requires_grad_() for _ in range(3))
        self.dout = torch.randn(t, h, d, generator=g)
        self.comm = RingComm(dist.group.WORLD)
        self.fwd, self.total, self.bytes = [], [], 0

    def step(self, record: bool):
        before = self.comm.bytes_sent
        dist.barrier()
        start = time.perf_counter()
        out = dacp_attention(self.q, self.k, self.v, self.layout, dist.group.WORLD,
                             backend="cpu_flash", comm=self.comm)
        mid = time.perf_counter()
        out.backward(self.dout)
        t = torch.tensor([mid - start, time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
        sent = torch.tensor([self.comm.bytes_sent - before], dtype=torch.float64)
        dist.all_reduce(sent)
        self.q.grad = self.k.grad = self.v.grad = None
        if record:
            self.fwd.append(float(t[0]))
            self.total.append(float(t[1]))
            self.bytes = int(sent)

    def summary(self):
        tokens = torch.tensor([self.layout.num_tokens], dtype=torch.float64)
        dist.all_reduce(tokens, op=dist.ReduceOp.MAX)
        return {"median_s": statistics.median(self.total), "min_s": min(self.total),
                "fwd_median_s": statistics.median(self.fwd), "times": self.total,
                "bytes": self.bytes, "max_rank_tokens": int(tokens)}


def worker(rank, args, store, out_path):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    lengths, placements = make_micro_batch(args)
    cases = {name: _Case(rank, args, lengths, *p) for name, p in placements.items()}
    for it in range(args.warmup + args.repeats):
        for case in cases.values():  # interleaved, so machine noise hits both alike
            case.step(record=it >= args.warmup)
    results = {name: case.summary() for name, case in cases.items()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"lengths": lengths, "results": results}, f)
    dist.destroy_process_group()


def print_table(report, args):
    lengths = report["lengths"]
    print(f"micro-batch: 1 x {lengths[0]} + {len(lengths) - 1} short ({min(lengths[1:])}-"
          f"{max(lengths[1:])}) tokens = {sum(lengths)} tokens; {args.heads} heads x "
          f"{args.head_dim}, float32, cp_size {args.world} (gloo, {args.threads} thread/rank), "
          f"median of {args.repeats} after {args.warmup} warm-up")
    rows = report["results"]
    base = rows["all distributed"]["median_s"]
    header = (f"{'placement':<38}{'fwd+bwd median s':>17}{'min s':>9}{'fwd median s':>13}"
              f"{'speed-up':>10}{'ring bytes':>14}{'max rank tokens':>17}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(f"{name:<38}{r['median_s']:>17.3f}{r['min_s']:>9.3f}{r['fwd_median_s']:>13.3f}"
              f"{base / r['median_s']:>9.2f}x"
              f"{r['bytes']:>14,}{r['max_rank_tokens']:>17,}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", type=int, default=8192, help="tokens of the long sequence")
    p.add_argument("--num-short", type=int, default=24)
    p.add_argument("--short-min", type=int, default=200)
    p.add_argument("--short-max", type=int, default=1500)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world", type=int, default=2, help="CP size (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if min(args.long, args.short_min, args.heads, args.head_dim, args.world, args.repeats) < 1 \
            or args.short_max < args.short_min:
        p.error("sizes, --world and --repeats must be >= 1 and --short-max >= --short-min")
    return args


def main(argv=None):
    args = parse_args(argv)
    run = results_io.start()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "report.json")
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store"), out_path),
                           nprocs=args.world, start_method="spawn")
        with open(out_path) as f:
            report = json.load(f)
    print_table(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    results_io.record("bench_attention", report, run, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
