"""Multi-process checks of the DACP attention, run many cases per spawn (gloo, CPU).

Every rank builds the same per-sample float64 inputs (same seed), packs its share with
its layout, runs ``dacp_attention`` forward and backward, and compares with a
single-process explicit-softmax causal attention of the un-sharded sequences.  Each
case's outcome ("ok" or a traceback) is written to ``<out>/result_<rank>.json``.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import traceback

import torch
import torch.distributed as dist

from skrull_ext.attention import RingComm, dacp_attention, get_kernel
from skrull_ext.attention.kernels import AttentionKernel
from skrull_ext.attention.layout import build_rank_layout


def reference_attention(q, k, v, scale):
    """Causal attention of one whole sequence, explicit softmax (autograd-aware)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    p = torch.softmax(s.masked_fill(mask, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vv)


def placement(kind, world):
    """``(lengths, distributed, local)`` of a named micro-batch for ``world`` CP ranks."""
    rest = [[] for _ in range(world - 1)]
    if kind == "all_local":
        lengths = [7, 3, 12, 5, 9, 1, 4, 6]
        local = [[i for i in range(len(lengths)) if i % world == r] for r in range(world)]
        return lengths, [], local
    if kind == "all_distributed":  # lengths not divisible by 2N, one of length 1, one exact
        lengths = [17, 8, 1, 30, 4 * world]
        return lengths, [3, 0, 2, 1, 4], [[] for _ in range(world)]
    if kind == "mixed":  # ranks >= 1 (world 2) or rank 1 (world 4) have no local part
        lengths = [13, 5, 22, 9, 1, 7, 2]
        local = [[1, 3, 4, 5]] + rest if world == 2 else [[1, 3], [], [4], [5]]
        return lengths, [2, 0, 6], local
    if kind == "no_tokens":  # nothing distributed; only rank 0 holds tokens
        return [6, 4, 1], [], [[0, 1, 2]] + rest
    if kind == "single_short":  # one distributed sequence shorter than the CP group
        return [1, 3], [0], [[1]] + rest
    raise KeyError(kind)


# name -> (placement, heads, kv_heads, head_dim, dtype, backend, scale, atol)
CASES = {
    "all_local": ("all_local", 2, 2, 8, torch.float64, "reference", None, 1e-10),
    "all_distributed": ("all_distributed", 2, 2, 8, torch.float64, "reference", None, 1e-10),
    "mixed": ("mixed", 2, 2, 8, torch.float64, "reference", None, 1e-10),
    "mixed_gqa": ("mixed", 4, 2, 8, torch.float64, "reference", None, 1e-10),
    "mixed_mqa_scale": ("mixed", 4, 1, 8, torch.float64, "reference", 0.3, 1e-10),
    "no_tokens": ("no_tokens", 2, 1, 8, torch.float64, "reference", None, 1e-10),
    "single_short": ("single_short", 2, 2, 4, torch.float64, "reference", None, 1e-10),
    "mixed_cpu_flash_f64": ("mixed", 4, 2, 8, torch.float64, "cpu_flash", None, 1e-10),
    "mixed_cpu_flash_f32": ("mixed", 4, 2, 16, torch.float32, "cpu_flash", None, 5e-5),
    "all_dist_cpu_flash_f32": ("all_distributed", 2, 2, 16, torch.float32, "cpu_flash", None, 5e-5),
    "mixed_cpu_flash_bf16": ("mixed", 4, 2, 16, torch.bfloat16, "cpu_flash", None, 3e-2),
}
EXTRA = ("overlap_order", "grad_through_layout", "bwd_group")
ALL_CASES = tuple(CASES) + EXTRA


def _inputs(lengths, h, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, heads: torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    qs = [mk(n, h) for n in lengths]
    ks = [mk(n, hk) for n in lengths]
    vs = [mk(n, hk) for n in lengths]
    dos = [mk(n, h) for n in lengths]
    return qs, ks, vs, dos


def _reference(qs, ks, vs, dos, samples, scale):
    """Per-sample output and dq/dk/dv of whole-sequence causal attention (float64)."""
    out, grads = {}, {}
    for s in samples:
        q, k, v = (t[s].clone().requires_grad_() for t in (qs, ks, vs))
        o = reference_attention(q, k, v, scale)
        grads[s] = torch.autograd.grad(o, (q, k, v), dos[s])
        out[s] = o.detach()
    return out, grads


def run_case(name, rank, world, comm_factory=None, kernel=None):
    place, h, hk, d, dtype, backend, scale, atol = CASES[name]
    lengths, distributed, local = placement(place, world)
    layout = build_rank_layout(lengths, distributed, local, rank, world)
    qs, ks, vs, dos = _inputs(lengths, h, hk, d, seed=1234)
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    ref_out, ref_grads = _reference(qs, ks, vs, dos, layout.samples, sc)
    q, k, v = (layout.pack(t).to(dtype).requires_grad_() for t in (qs, ks, vs))
    comm = comm_factory() if comm_factory else None
    out = dacp_attention(q, k, v, layout, dist.group.WORLD, softmax_scale=scale,
                         backend=kernel or backend, comm=comm)
    out.backward(layout.pack(dos).to(dtype))  # padding rows get zero gradient
    if layout.num_tokens == 0:  # still took part; nothing to compare
        assert out.shape == (0, h, d) and q.grad.shape == (0, h, d) and k.grad.shape == (0, hk, d)
        return layout
    real = ~layout.is_padding
    tol = dict(atol=atol, rtol=min(atol * 10, 5e-2))
    got_out = out.detach().double()[real]
    torch.testing.assert_close(got_out, layout.pack(ref_out)[real], **tol)
    for i, (got, label) in enumerate(((q.grad, "dq"), (k.grad, "dk"), (v.grad, "dv"))):
        want = layout.pack({s: g[i] for s, g in ref_grads.items()})
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{label}: {m}")
    assert torch.isfinite(out).all(), "padding rows must stay finite"
    return layout


class _Recorder:
    """Shared event log of a recording communicator and kernel."""

    def __init__(self):
        self.events = []


class RecordingComm:
    """Wraps :class:`RingComm`, logging posts and waits."""

    def __init__(self, inner, rec):
        self.inner, self.rec = inner, rec
        self.rank, self.size = inner.rank, inner.size

    def send_recv_async(self, send, *, channel="fwd_kv"):
        self.rec.events.append(("post", channel))
        return self.inner.send_recv_async(send, channel=channel)

    def wait(self, channel="fwd_kv"):
        self.rec.events.append(("wait", channel))
        self.inner.wait(channel)


class RecordingKernel(AttentionKernel):
    """Wraps a kernel, logging every call with its query count and causal flag."""

    def __init__(self, inner, rec):
        self.inner, self.rec = inner, rec

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        self.rec.events.append(("fwd", q.shape[0], causal))
        return self.inner.forward(q, k, v, cu_q, cu_k, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        self.rec.events.append(("bwd", q.shape[0], causal))
        return self.inner.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=scale)


def check_overlap_order(rank, world):
    rec = _Recorder()
    kernel = RecordingKernel(get_kernel("reference", torch.device("cpu"), torch.float64), rec)
    layout = run_case("mixed", rank, world,
                      comm_factory=lambda: RecordingComm(RingComm(dist.group.WORLD), rec), kernel=kernel)
    ev = rec.events
    nl = layout.num_local_tokens
    fwd = ev[:ev.index(("post", "bwd_kv"))]
    bwd = ev[len(fwd):]
    for phase, chan, kind in ((fwd, "fwd_kv", "fwd"), (bwd, "bwd_kv", "bwd")):
        assert phase[0] == ("post", chan), f"first event must post the {chan} exchange: {phase[:3]}"
        first_wait = phase.index(("wait", chan))
        if nl:
            assert phase[1] == (kind, nl, True), f"local attention must follow the post: {phase[:4]}"
            assert phase.index((kind, nl, True)) < first_wait
        assert phase.count(("post", chan)) == world - 1
    # dK/dV accumulators make N - 1 hops (the owner keeps its step-0 gradients).
    assert bwd.count(("post", "bwd_dkv")) == world - 1
    assert bwd.count(("wait", "bwd_dkv")) == world - 1


def check_grad_through_layout(rank, world):
    """Loss on unpacked outputs; gradients of the per-sample inputs summed over ranks."""
    lengths, distributed, local = placement("mixed", world)
    layout = build_rank_layout(lengths, distributed, local, rank, world)
    qs, ks, vs, ws = _inputs(lengths, 4, 2, 8, seed=99)
    leaves = [t.clone().requires_grad_() for t in qs + ks + vs]
    n = len(lengths)
    per = layout.unpack(dacp_attention(*(layout.pack(leaves[i * n:(i + 1) * n]) for i in range(3)),
                                       layout, dist.group.WORLD, backend="reference"))
    loss = sum((o * ws[s]).sum() for s, o in per.items())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    ref_leaves = [t.clone().requires_grad_() for t in qs + ks + vs]
    ref_loss = sum((reference_attention(ref_leaves[s], ref_leaves[n + s], ref_leaves[2 * n + s],
                                        1 / math.sqrt(8)) * ws[s]).sum() for s in range(n))
    ref = torch.cat([g.reshape(-1) for g in torch.autograd.grad(ref_loss, ref_leaves)])
    torch.testing.assert_close(flat, ref, atol=1e-10, rtol=1e-9)


def check_bwd_group(rank, world):
    """Backward channels on a separate process group give the same result."""
    bwd = dist.new_group(list(range(world)))
    run_case("mixed_gqa", rank, world, comm_factory=lambda: RingComm(dist.group.WORLD, bwd_group=bwd))


def worker(rank, world, store, out_dir, names):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in names:
        try:
            if name == "overlap_order":
                check_overlap_order(rank, world)
            elif name == "grad_through_layout":
                check_grad_through_layout(rank, world)
            elif name == "bwd_group":
                check_bwd_group(rank, world)
            else:
                run_case(name, rank, world)
            results[name] = "ok"
        except Exception:  # reported per case; the other cases still run
            results[name] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
