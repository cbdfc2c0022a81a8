"""One command for the first GPU machine: are the GPU attention kernels right and useful?

    python tools/check_gpu.py                 # needs CUDA; 2 GPUs for the CP=2 sections
    python tools/check_gpu.py --dry-run       # anywhere: the plan, shapes and calls only

Three sections, printed as one report (``--json FILE`` also writes it):

1. **Kernel parity** (1 GPU): every installed kernel (``flash``, ``te``) in bf16 and fp16
   against the float64 reference kernel on the same inputs: varlen blocks (causal and the
   ring's non-causal shapes, ``flash``) and ``dacp_attention`` on a packed micro-batch,
   outputs and gradients, error relative to the reference's largest value.
2. **Training loss parity** (2 GPUs): the launcher on a small mock-data model with CP=2 on
   2 GPUs against CP=1 on 1 GPU, per kernel; per-iteration losses must agree (bf16).
3. **DACP attention time** (2 GPUs): forward + backward of one mixed micro-batch (a long
   distributed sequence and many short local ones) per kernel, with the side stream on and
   off (``SKRULL_ATTENTION_SIDE_STREAM``), medians of CUDA-event timings.

Bad input or a missing GPU is one ``error:`` line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from skrull_ext.attention import ReferenceKernel, dacp_attention, get_kernel  # noqa: E402
from skrull_ext.attention.choice import flash_attn_available, te_available  # noqa: E402
from skrull_ext.attention.layout import build_rank_layout  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Largest |error| / largest |reference| allowed (inputs ~ N(0, 1), fp32 accumulation).
TOLERANCE = {"bf16": {"out": 2e-2, "grad": 4e-2}, "fp16": {"out": 3e-3, "grad": 6e-3}}
LOSS_RTOL = 2e-2  # bf16 autocast, CP=2 vs CP=1 per iteration
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
BLOCK_CU = (0, 1000, 1001, 3000, 4096)  # document lengths 1000, 1, 1999, 1096
MB_LENGTHS = [300 + 97 * i for i in range(12)] + [3000]  # parity micro-batch (last one long)
TRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
               "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
               "--disable-bias-linear", "--seq-length", "2048", "--global-batch-size", "16",
               "--lr", "1e-3", "--lr-warmup-iters", "0", "--train-iters", "8",
               "--skrull-bucket-size", "2048", "--mock-data", "--mock-num-samples", "256",
               "--log-interval", "1", "--device", "cuda", "--seed", "7"]


def _rand(shape, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)


def _rel_err(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12))


def block_cases():
    """``(label, cu_q, cu_k, causal)`` of the varlen blocks the ring calls."""
    half = tuple(x // 2 for x in BLOCK_CU)
    return [("block causal (local, ring step 0)", BLOCK_CU, BLOCK_CU, True),
            ("block q x first chunks (src < rank)", BLOCK_CU, half, False),
            ("block second chunks x k (src > rank)", half, BLOCK_CU, False)]


def micro_batch_layout():
    """A single-GPU micro-batch: short documents and a long one (held whole at CP=1)."""
    n = len(MB_LENGTHS)
    return build_rank_layout(MB_LENGTHS, [n - 1], [list(range(n - 1))], 0, 1)


def parity_rows(kernel: str, device, dtype, dtype_name: str, plan_only: bool = False):
    """Parity rows ``{kernel, dtype, case, out, grad, ok}`` (or the calls, ``plan_only``)."""
    rows, scale = [], 1 / math.sqrt(HEAD_DIM)
    tol = TOLERANCE.get(dtype_name, {"out": 1e-9, "grad": 1e-9})
    cases = block_cases() if kernel == "flash" else []
    for label, cu_q, cu_k, causal in cases:
        shapes = f"q [{cu_q[-1]}, {HEADS}, {HEAD_DIM}] k/v [{cu_k[-1]}, {KV_HEADS}, {HEAD_DIM}]"
        if plan_only:
            rows.append(f"{kernel} {dtype_name} {label}: forward+backward {shapes}, "
                        f"{len(cu_q) - 1} segments, causal={causal}")
            continue
        q, k, v, do = (_rand((n, h, HEAD_DIM), s, device) for n, h, s in (
            (cu_q[-1], HEADS, 1), (cu_k[-1], KV_HEADS, 2), (cu_k[-1], KV_HEADS, 3),
            (cu_q[-1], HEADS, 4)))
        ref = ReferenceKernel()
        ro, rl = ref.forward(q, k, v, cu_q, cu_k, causal=causal, scale=scale)
        rg = ref.backward(do, q, k, v, ro, rl, cu_q, cu_k, causal=causal, scale=scale)
        kern = get_kernel(kernel, device, dtype)
        lo = [t.to(dtype) for t in (q, k, v, do)]
        o, l = kern.forward(*lo[:3], cu_q, cu_k, causal=causal, scale=scale)
        g = kern.backward(lo[3], *lo[:3], o, l, cu_q, cu_k, causal=causal, scale=scale)
        rows.append(_row(kernel, dtype_name, label, _rel_err(o, ro),
                         max(_rel_err(a, b) for a, b in zip(g, rg)), tol))
    layout = micro_batch_layout()
    label = f"dacp_attention, {layout.num_tokens} tokens, {len(layout.local_samples) + 1} docs"
    if plan_only:
        rows.append(f"{kernel} {dtype_name} {label}: q [{layout.num_tokens}, {HEADS}, "
                    f"{HEAD_DIM}], backend={kernel!r} vs 'reference' (float64), grads of q/k/v")
        return rows
    t = [_rand((layout.num_tokens, h, HEAD_DIM), s, device)
         for h, s in ((HEADS, 5), (KV_HEADS, 6), (KV_HEADS, 7))]
    w = _rand((layout.num_tokens, HEADS, HEAD_DIM), 8, device)
    outs = {}
    for name, dt in ((kernel, dtype), ("reference", torch.float64)):
        leaves = [x.to(dt).clone().requires_grad_() for x in t]  # own leaves per run
        out = dacp_attention(*leaves, layout, None, backend=name)
        (out.double() * w).sum().backward()
        outs[name] = (out.detach(), [x.grad for x in leaves])
    (o, g), (ro, rg) = outs[kernel], outs["reference"]
    rows.append(_row(kernel, dtype_name, label, _rel_err(o, ro),
                     max(_rel_err(a, b) for a, b in zip(g, rg)), tol))
    return rows


def _row(kernel, dtype_name, case, out_err, grad_err, tol):
    return {"kernel": kernel, "dtype": dtype_name, "case": case, "out": out_err,
            "grad": grad_err, "ok": out_err <= tol["out"] and grad_err <= tol["grad"]}


def training_commands(kernel: str, python: str = sys.executable):
    """``{label: argv}`` of the loss-parity runs (CP=1 on 1 GPU, CP=2 on 2 GPUs)."""
    torchrun = [python, "-m", "torch.distributed.run", "--standalone"]
    flags = TRAIN_FLAGS + ["--skrull-attention-kernel", kernel]
    return {"cp1": torchrun + ["--nproc-per-node", "1", "-m", "megatron.skrull.pretrain_gpt",
                               *flags, "--context-parallel-size", "1"],
            "cp2": torchrun + ["--nproc-per-node", "2", "-m", "megatron.skrull.pretrain_gpt",
                               *flags, "--context-parallel-size", "2"]}


def parse_losses(stdout: str) -> list[float]:
    """Per-iteration losses of the launcher's log lines."""
    return [float(x) for x in re.findall(r" iteration +\d+/ *\d+ \| loss ([-+.\dEe]+)", stdout)]


def training_parity(kernel: str) -> dict:
    runs = {}
    for label, argv in training_commands(kernel).items():
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PYTHONPATH": ROOT})
        runs[label] = parse_losses(proc.stdout)
        if proc.returncode or not runs[label]:
            return {"kernel": kernel, "ok": False, "error": proc.stderr[-1500:]}
    a, b = runs["cp1"], runs["cp2"]
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    return {"kernel": kernel, "cp1": a, "cp2": b, "max_rel_diff": worst,
            "ok": len(a) == len(b) and worst <= LOSS_RTOL}


def timing_layouts(world: int = 2):
    """Per-rank layouts of the timed micro-batch: one 32K sequence distributed, 48 short ones
    (256-1,200 tokens) local, balanced over the ranks."""
    lengths = [32768] + [256 + (i * 389) % 945 for i in range(48)]
    local = [[i for i in range(1, 49) if i % world == r] for r in range(world)]
    return [build_rank_layout(lengths, [0], local, r, world) for r in range(world)]


def timing_command(kernel: str, python: str = sys.executable):
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.abspath(__file__), "--worker-timing", kernel]


def timing_worker(kernel: str, repeats: int = 10) -> None:
    """Runs under torchrun (2 GPUs); rank 0 prints one JSON line per side-stream setting."""
    import torch.distributed as dist

    from skrull_ext.attention.streams import SIDE_STREAM_ENV

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", rank)
    layout = timing_layouts(dist.get_world_size())[rank]
    x = [_rand((layout.num_tokens, h, HEAD_DIM), s, device).to(torch.bfloat16).requires_grad_()
         for h, s in ((HEADS, 1), (KV_HEADS, 2), (KV_HEADS, 3))]
    for side in ("1", "0"):
        os.environ[SIDE_STREAM_ENV] = side
        times = []
        for i in range(repeats + 2):  # two warm-up iterations
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dacp_attention(*x, layout, dist.group.WORLD, backend=kernel).sum().backward()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        t = torch.tensor([sorted(times)[len(times) // 2]], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        if rank == 0:
            print(json.dumps({"kernel": kernel, "side_stream": side == "1", "ms": float(t)}),
                  flush=True)
    dist.destroy_process_group()


def timing_rows(kernel: str) -> list[dict]:
    proc = subprocess.run(timing_command(kernel), cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "PYTHONPATH": ROOT})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return rows or [{"kernel": kernel, "error": proc.stderr[-1500:]}]


def available_kernels() -> list[str]:
    return [k for k, ok in (("flash", flash_attn_available()), ("te", te_available())) if ok]


def dry_run(kernels: list[str], dtypes: list[str], out) -> dict:
    """Prints what a GPU run would do; builds every layout and shape on the way."""
    plan = {"kernels": kernels, "dtypes": dtypes, "parity": [], "training": {}, "timing": {}}
    print("== 1. kernel parity (1 GPU) vs the float64 reference", file=out)
    for k in kernels:
        for d in dtypes:
            for line in parity_rows(k, torch.device("cpu"), None, d, plan_only=True):
                plan["parity"].append(line)
                print("  " + line, file=out)
    print(f"== 2. training loss parity (2 GPUs), per-iteration rel diff <= {LOSS_RTOL}",
          file=out)
    for k in kernels:
        plan["training"][k] = cmds = training_commands(k, "python")
        for label, argv in cmds.items():
            print(f"  {k} {label}: {' '.join(argv)}", file=out)
    print("== 3. DACP attention time, side stream on/off (2 GPUs, bf16, fwd+bwd)", file=out)
    for r, lay in enumerate(timing_layouts()):
        print(f"  rank {r}: {lay.num_tokens} tokens = {lay.num_local_tokens} local "
              f"({len(lay.local_samples)} docs) + {lay.num_distributed_tokens} distributed",
              file=out)
    for k in kernels:
        plan["timing"][k] = cmd = timing_command(k, "python")
        print(f"  {k}: {' '.join(cmd)}  (SKRULL_ATTENTION_SIDE_STREAM=1, then 0)", file=out)
    return plan


def report(results: dict, out) -> bool:
    ok = True
    print("== 1. kernel parity: max |err| / max |ref|", file=out)
    for r in results["parity"]:
        ok &= r["ok"]
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['kernel']:5s} {r['dtype']} "
              f"out {r['out']:.2e} grad {r['grad']:.2e}  {r['case']}", file=out)
    print("== 2. training loss parity (CP=2 on 2 GPUs vs CP=1)", file=out)
    for r in results["training"]:
        ok &= r["ok"]
        print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['kernel']}: "
              + (f"max rel diff {r['max_rel_diff']:.2e}" if "max_rel_diff" in r else r.get(
                  "error", "")), file=out)
    print("== 3. DACP attention fwd+bwd (ms, slowest rank, median)\n  kernel | side stream "
          "on | off | ratio", file=out)
    for k, rows in results["timing"].items():
        by = {r.get("side_stream"): r.get("ms") for r in rows}
        if None in by.values() or len(by) < 2:
            ok = False
            print(f"  {k} | FAIL {rows[0].get('error', '')}", file=out)
        else:
            print(f"  {k} | {by[True]:.2f} | {by[False]:.2f} | {by[False] / by[True]:.2f}x",
                  file=out)
    return ok


def main(argv: Optional[list] = None, out=sys.stdout) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    ap.add_argument("--kernels", default=None, help="comma list of flash,te (default: installed; "
                    "both with --dry-run)")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--json", help="also write the results (or the plan) to this file")
    ap.add_argument("--worker-timing", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_timing:
        timing_worker(args.worker_timing)
        return 0
    dtypes = [d for d in args.dtypes.split(",") if d]
    kernels = ([k for k in args.kernels.split(",") if k] if args.kernels else
               ["flash", "te"] if args.dry_run else available_kernels())
    bad = [d for d in dtypes if d not in DTYPES] + [k for k in kernels if k not in ("flash", "te")]
    if bad:
        print(f"error: unknown {bad}: --kernels takes flash,te and --dtypes bf16,fp16",
              file=sys.stderr)
        return 2
    if args.dry_run:
        result = dry_run(kernels, dtypes, out)
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device: run on a GPU machine, or pass --dry-run for the plan",
                  file=sys.stderr)
            return 2
        if not kernels:
            print("error: neither Transformer Engine nor flash-attn imports: pip install "
                  "--no-build-isolation '.[gpu]' (README 'GPU kernels')", file=sys.stderr)
            return 2
        two = torch.cuda.device_count() >= 2
        result = {"parity": [r for k in kernels for d in dtypes
                             for r in parity_rows(k, torch.device("cuda"), DTYPES[d], d)],
                  "training": [training_parity(k) for k in kernels] if two else [],
                  "timing": {k: timing_rows(k) for k in kernels} if two else {}}
        if not two:
            print("note: 1 GPU: the CP=2 sections (2, 3) need 2", file=out)
        ok = report(result, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if args.dry_run or ok else 1


if __name__ == "__main__":
    sys.exit(main())
