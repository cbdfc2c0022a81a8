"""Sections 1-2 of ``tools/check_gpu.py``: kernel parity against the float64 reference and
kernel time, one GPU, in this process.

Parity: every kernel in bf16 and fp16 on the ring's three varlen block shapes (causal: the
local documents and ring step 0; query x first chunks and second chunks x keys: the steps
from lower and higher ranks) and ``dacp_attention`` on a packed micro-batch, GQA; errors
are max |error| / max |reference| of outputs and gradients, and max |error| of the LSE.
Time: forward and forward+backward of causal varlen attention per kernel on Qwen2.5 head
shapes with documents of 1K-32K tokens, CUDA-event medians (the first call, with its lazy
initialisation, reported apart).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from skrull_ext.attention import ReferenceKernel, dacp_attention, get_kernel
from skrull_ext.attention import aten
from skrull_ext.attention.choice import flash_attn_available, te_available
from skrull_ext.attention.kernels import segments
from skrull_ext.attention.layout import build_rank_layout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNELS = ("torch", "flash", "te")
#: Largest |error| / largest |reference| allowed (inputs ~ N(0, 1), fp32 accumulation), and
#: the largest |LSE error| (a wrong layout or log base is off by O(1)).
TOLERANCE = {"bf16": {"out": 2e-2, "grad": 4e-2, "lse": 5e-2},
             "fp16": {"out": 3e-3, "grad": 6e-3, "lse": 1e-2}}
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
#: Per document the zigzag chunk size ``c`` of the ring blocks: shards of ``2c`` tokens (one
#: document of 2 tokens, chunks of 1), first chunks of ``c``; every chunk holds a token.
BLOCK_CHUNKS = (500, 1, 1000, 548)
MB_LENGTHS = [300 + 97 * i for i in range(12)] + [3000]  # parity micro-batch (last one long)
#: (label, heads, KV heads, head dim) of the timed shapes, and the timed document mixes.
TIMING_SHAPES = (("Qwen2.5-0.5B 14/2x64", 14, 2, 64), ("Qwen2.5-1.5B 12/2x128", 12, 2, 128))
TIMING_DOCS = {"1K-32K": [32768, 16384, 8192, 4096, 2048, 1024],
               "48 x 1-2K": [1024 + (i * 389) % 1024 for i in range(48)]}


def available_kernels(device: torch.device) -> list[str]:
    """The kernels that can run on ``device``, in :data:`KERNELS` order."""
    ok = {"torch": aten.flash_op_problem(device) is None,
          "flash": flash_attn_available(), "te": te_available()}
    return [k for k in KERNELS if ok[k]]


def rand(shape, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)


def rel_err(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12))


def block_cases():
    """``(label, cu_q, cu_k, causal)`` of the varlen blocks the ring calls."""
    half, full = [0], [0]
    for c in BLOCK_CHUNKS:
        half.append(half[-1] + c)
        full.append(full[-1] + 2 * c)
    half, full = tuple(half), tuple(full)
    return [("block causal (local, ring step 0)", full, full, True),
            ("block q x first chunks (src < rank)", full, half, False),
            ("block second chunks x k (src > rank)", half, full, False)]


def micro_batch_layout():
    """A single-GPU micro-batch: short documents and a long one (held whole at CP=1)."""
    n = len(MB_LENGTHS)
    return build_rank_layout(MB_LENGTHS, [n - 1], [list(range(n - 1))], 0, 1)


def row(kernel, dtype_name, case, out_err, grad_err, tol, lse_err=None) -> dict:
    ok = out_err <= tol["out"] and grad_err <= tol["grad"] and (
        lse_err is None or lse_err <= tol["lse"])
    return {"kernel": kernel, "dtype": dtype_name, "case": case, "out": out_err,
            "grad": grad_err, "lse": lse_err, "ok": ok}


def _block_row(kernel, device, dtype, dtype_name, case, tol, scale):
    label, cu_q, cu_k, causal = case
    q, k, v, do = (rand((n, h, HEAD_DIM), s, device) for n, h, s in (
        (cu_q[-1], HEADS, 1), (cu_k[-1], KV_HEADS, 2), (cu_k[-1], KV_HEADS, 3),
        (cu_q[-1], HEADS, 4)))
    ref = ReferenceKernel()
    ro, rl = ref.forward(q, k, v, cu_q, cu_k, causal=causal, scale=scale)
    rg = ref.backward(do, q, k, v, ro, rl, cu_q, cu_k, causal=causal, scale=scale)
    kern = get_kernel(kernel, device, dtype)
    sq, sk = segments(cu_q, device), segments(cu_k, device)
    lo = [t.to(dtype) for t in (q, k, v, do)]
    o, lse = kern.forward(*lo[:3], sq, sk, causal=causal, scale=scale)
    g = kern.backward(lo[3], *lo[:3], o, lse, sq, sk, causal=causal, scale=scale)
    seen = torch.isfinite(rl)  # queries with keys (flash-attn gives +inf for none)
    lse_err = float((lse.double() - rl)[seen].abs().max())
    return row(kernel, dtype_name, label, rel_err(o, ro),
               max(rel_err(a, b) for a, b in zip(g, rg)), tol, lse_err)


def parity_rows(kernel: str, device, dtype, dtype_name: str, plan_only: bool = False):
    """Parity rows ``{kernel, dtype, case, out, grad, lse, ok}`` (or the calls, ``plan_only``)."""
    rows, scale = [], 1 / math.sqrt(HEAD_DIM)
    tol = TOLERANCE.get(dtype_name, {"out": 1e-9, "grad": 1e-9, "lse": 1e-9})
    for case in (block_cases() if kernel != "te" else []):  # te has no block API
        if plan_only:
            label, cu_q, cu_k, causal = case
            rows.append(f"{kernel} {dtype_name} {label}: q [{cu_q[-1]}, {HEADS}, {HEAD_DIM}] "
                        f"k/v [{cu_k[-1]}, {KV_HEADS}, {HEAD_DIM}], {len(cu_q) - 1} segments, "
                        f"causal={causal}")
        else:
            rows.append(_guarded(lambda: _block_row(kernel, device, dtype, dtype_name, case, tol,
                                                    scale), kernel, dtype_name, case[0]))
    layout = micro_batch_layout()
    label = f"dacp_attention, {layout.num_tokens} tokens, {len(layout.local_samples) + 1} docs"
    if plan_only:
        rows.append(f"{kernel} {dtype_name} {label}: q [{layout.num_tokens}, {HEADS}, "
                    f"{HEAD_DIM}], backend={kernel!r} vs 'reference' (float64), grads of q/k/v")
        return rows
    rows.append(_guarded(lambda: _dacp_row(kernel, device, dtype, dtype_name, layout, label, tol),
                         kernel, dtype_name, label))
    return rows


def _dacp_row(kernel, device, dtype, dtype_name, layout, label, tol):
    t = [rand((layout.num_tokens, h, HEAD_DIM), s, device)
         for h, s in ((HEADS, 5), (KV_HEADS, 6), (KV_HEADS, 7))]
    w = rand((layout.num_tokens, HEADS, HEAD_DIM), 8, device)
    outs = {}
    for name, dt in ((kernel, dtype), ("reference", torch.float64)):
        leaves = [x.to(dt).clone().requires_grad_() for x in t]  # own leaves per run
        out = dacp_attention(*leaves, layout, None, backend=name)
        (out.double() * w).sum().backward()
        outs[name] = (out.detach(), [x.grad for x in leaves])
    (o, g), (ro, rg) = outs[kernel], outs["reference"]
    return row(kernel, dtype_name, label, rel_err(o, ro),
               max(rel_err(a, b) for a, b in zip(g, rg)), tol)


def _guarded(fn, kernel, dtype_name, case) -> dict:
    """A row, or a failed row carrying the error (one kernel failing stops nothing)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"kernel": kernel, "dtype": dtype_name, "case": case, "ok": False,
                "error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def causal_flops(lengths, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention over documents (two matmuls, half the scores)."""
    return 4.0 * heads * head_dim * sum(n * (n + 1) / 2 for n in lengths)


def _elapsed(fn, repeats: int) -> float:
    """Median CUDA-event milliseconds of ``fn()``."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timing_rows(kernels, device, repeats: int = 5) -> list[dict]:
    """Forward and backward time of causal varlen attention per kernel, shape and mix."""
    rows = []
    for shape, h, hk, d in TIMING_SHAPES:
        for mix, lengths in TIMING_DOCS.items():
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            seg, t = segments(cu, device), cu[-1]
            q, k, v, do = (torch.randn(t, heads, d, device=device, dtype=torch.bfloat16)
                           for heads in (h, hk, hk, h))
            flops = causal_flops(lengths, h, d)
            for name in kernels:
                rows.append(_guarded(lambda: _time_kernel(name, device, q, k, v, do, seg, flops,
                                                          repeats), name, "bf16", shape))
                rows[-1].update(shape=shape, docs=mix, tokens=t)
    return rows


def _time_kernel(name, device, q, k, v, do, seg, flops, repeats) -> dict:
    kern = get_kernel(name, device, q.dtype)
    scale = q.shape[-1] ** -0.5
    fwd = lambda: kern.forward(q, k, v, seg, seg, causal=True, scale=scale)  # noqa: E731
    first = _elapsed(lambda: kern.backward(do, q, k, v, *fwd(), seg, seg, causal=True,
                                           scale=scale), 1)  # lazy set-up lands here
    out, lse = fwd()
    fwd_ms = _elapsed(fwd, repeats)
    bwd_ms = _elapsed(lambda: kern.backward(do, q, k, v, out, lse, seg, seg, causal=True,
                                            scale=scale), repeats)
    return {"kernel": name, "ok": True, "first_ms": first, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            "tflops": 3.5 * flops / ((fwd_ms + bwd_ms) * 1e-3) / 1e12}  # bwd = 2.5 x fwd


def timing_plan() -> list[str]:
    """What :func:`timing_rows` times (for ``--dry-run``)."""
    return [f"{shape}, {mix}: {sum(lengths)} tokens in {len(lengths)} causal documents, bf16, "
            f"forward and backward ({causal_flops(lengths, h, d) / 1e12:.2f} TFLOP forward)"
            for shape, h, hk, d in TIMING_SHAPES for mix, lengths in TIMING_DOCS.items()]


def summarize_timing(rows) -> Optional[str]:
    """``kernel: fwd+bwd ms`` of the first timed shape, for the summary table."""
    best = [r for r in rows if r.get("ok") and r.get("docs") == "1K-32K"]
    return ", ".join(f"{r['kernel']} {r['shape'].split()[0]} {r['fwd_ms'] + r['bwd_ms']:.1f} ms"
                     for r in best) or None
