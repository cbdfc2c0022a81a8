"""Multi-process checks of the DACP attention, run many cases per spawn (gloo, CPU).

Every rank builds the same per-sample float64 inputs (same seed), packs its share with
its layout, runs ``dacp_attention`` forward and backward, and compares with a
single-process causal attention (torch SDPA) of the un-sharded sequences.  Each
case's outcome ("ok" or a traceback) is written to ``<out>/result_<rank>.json``.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import json
import math
import os
import sys
import traceback
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from skrull_ext.attention import RingComm, dacp_attention, get_kernel
from skrull_ext.attention.kernels import AttentionKernel
from skrull_ext.attention.layout import build_rank_layout

import fakes


def reference_attention(q, k, v, scale):
    """Causal attention of one whole sequence by torch's SDPA (autograd-aware, any dtype).

    ``q [S, H, D]``, ``k/v [S, Hkv, D]`` -> ``[S, H, D]``.
    """
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1),
                                         vv.transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


def single_rank_parity(backend):
    """``dacp_attention`` with ``backend`` and no CP group (local and whole distributed
    documents, GQA) against whole-sequence attention in float64: outputs and gradients."""
    g = torch.Generator().manual_seed(20)
    lengths = [7, 1, 12, 4]
    lay = build_rank_layout(lengths, [2, 0], [[3, 1]], 0, 1)
    qs, ks, vs = ([torch.randn(n, h, 8, generator=g, dtype=torch.float64).requires_grad_()
                   for n in lengths] for h in (4, 2, 2))
    out = dacp_attention(*(lay.pack(t) for t in (qs, ks, vs)), lay, None, backend=backend)
    ref = lay.pack([reference_attention(q, k, v, 1 / math.sqrt(8)) for q, k, v in zip(qs, ks, vs)])
    w = torch.randn(*out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), qs + ks + vs)
    want = torch.autograd.grad((ref * w).sum(), qs + ks + vs)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


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
    if kind == "grouped":  # local + distributed + two sub-groups (world 4) + a one-rank one
        lengths = [13, 5, 22, 9, 3, 7, 2, 11, 6]
        local = [[1, 3], [], [4], [5]] if world == 4 else [[1, 3, 4], [5]]
        return lengths, [2, 0], local
    if kind == "grouped_partial":  # no full ring; world 4: ranks 0 and 1 in no sub-group
        lengths = [9, 4, 15, 1, 6]
        return lengths, [], [[1], [3]] + ([[], []] if world == 4 else [])
    raise KeyError(kind)


def grouped_placement(kind, world):
    """``MicroBatch.grouped`` of a named micro-batch: ``(sample, first_rank, n_ranks)``."""
    if kind == "grouped":  # samples 6 and 8 share the sub-group {0, 1}: one ring
        if world == 4:
            return [(6, 0, 2), (7, 2, 2), (8, 0, 2)]
        return [(6, 0, 2), (7, 1, 1), (8, 0, 2)]
    if kind == "grouped_partial":
        return [(0, world - 2, 2), (2, world - 2, 2), (4, world - 1, 1)]
    return []


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
    # Through fakes of the GPU libraries (tests/fakes), same float64 parity:
    "mixed_fake_flash_2.6": ("mixed", 4, 2, 8, torch.float64, "fake_flash:2.6.3", None, 1e-10),
    "mixed_fake_flash_2.7.0": ("mixed", 4, 2, 8, torch.float64, "fake_flash:2.7.0", None, 1e-10),
    "mixed_fake_flash_2.8": ("mixed", 4, 2, 8, torch.float64, "fake_flash:2.8.3", None, 1e-10),
    "all_dist_fake_flash_2.8": ("all_distributed", 2, 2, 8, torch.float64, "fake_flash:2.8.3",
                                None, 1e-10),
    "mixed_fake_te": ("mixed", 4, 2, 8, torch.float64, "fake_te:2.9", None, 1e-10),
    # PyTorch's own CUDA varlen ops (tests/fakes/aten.py): flash, padded-LSE flash
    "mixed_fake_aten": ("mixed", 4, 2, 8, torch.float64, "fake_aten:2.13", None, 1e-10),
    "all_dist_fake_aten_padded": ("all_distributed", 2, 1, 8, torch.float64,
                                  "fake_aten:padded", 0.3, 1e-10),
    "all_dist_fake_te": ("all_distributed", 2, 1, 8, torch.float64, "fake_te:2.9", 0.3, 1e-10),
    "single_short_fake_te_1.13": ("single_short", 2, 2, 4, torch.float64, "fake_te:1.13", None,
                                  1e-10),
    # Hybrid-CP sub-group rings (grouped placements) after the full ring:
    "grouped": ("grouped", 4, 2, 8, torch.float64, "reference", None, 1e-10),
    "grouped_partial_cpu_flash": ("grouped_partial", 2, 1, 8, torch.float64, "cpu_flash", 0.3,
                                  1e-10),
    "grouped_fake_te_flash": ("grouped", 4, 2, 8, torch.float64, "fake_te+flash:2.9", None,
                              1e-10),
}
EXTRA = ("overlap_order", "grad_through_layout", "bwd_group", "stream_order_flash",
         "stream_order_te", "no_host_sync", "grouped_order", "warm_up", "host_staged")
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


def run_case(name, rank, world, comm_factory=None, kernel=None, log=None):
    place, h, hk, d, dtype, backend, scale, atol = CASES[name]
    lengths, distributed, local = placement(place, world)
    layout = build_rank_layout(lengths, distributed, local, rank, world,
                               grouped_placement(place, world))
    qs, ks, vs, dos = _inputs(lengths, h, hk, d, seed=1234)
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    ref_out, ref_grads = _reference(qs, ks, vs, dos, layout.samples, sc)
    q, k, v = (layout.pack(t).to(dtype).requires_grad_() for t in (qs, ks, vs))
    comm = comm_factory() if comm_factory else None
    with fake_backend(backend, log) as name:
        out = dacp_attention(q, k, v, layout, dist.group.WORLD, softmax_scale=scale,
                             backend=kernel or name, comm=comm)
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


@contextlib.contextmanager
def fake_backend(backend, log=None):
    """``"fake_flash:2.8.3"`` / ``"fake_te:2.9"``: the fake package installed for the
    block (yields the kernel name to ask for); other names pass through."""
    if not isinstance(backend, str) or not backend.startswith("fake_"):
        yield backend
        return
    kind, version = backend[len("fake_"):].split(":")
    if kind == "aten":  # kernel instances over fake ops: nothing to install
        from fakes import aten as fake_aten
        from skrull_ext.attention import aten

        yield aten.TorchVarlenKernel(ops=fake_aten.ops(version))
        return
    if kind == "te+flash":  # TE for the full ring, flash-attn for the sub-group rings
        mods = {**fakes.install_in_process("flash", "2.8.3", log),
                **fakes.install_in_process("te", version, log)}
        kind = "te"
    else:
        mods = fakes.install_in_process(kind, version, log)
    try:
        yield kind
    finally:
        fakes.uninstall_in_process(mods)


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
        self.rec.events.append(("post", self.prefix + channel))
        return self.inner.send_recv_async(send, channel=channel)

    def wait(self, channel="fwd_kv"):
        self.rec.events.append(("wait", self.prefix + channel))
        self.inner.wait(channel)

    def subgroup(self, first, size):
        """A recording sub-group ring; its channels are logged as ``"first+size:channel"``."""
        sub = RecordingComm(self.inner.subgroup(first, size), self.rec)
        sub.prefix = f"{first}+{size}:"
        return sub

    prefix = ""


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


def check_grouped_order(rank, world):
    """Sub-group rings run after the full ring and the local part, one after another in
    the layout's order, forward and backward (as the cost model charges them)."""
    rec = _Recorder()
    kernel = RecordingKernel(get_kernel("reference", torch.device("cpu"), torch.float64), rec)
    layout = run_case("grouped", rank, world, kernel=kernel,
                      comm_factory=lambda: RecordingComm(RingComm(dist.group.WORLD), rec))
    ev = rec.events
    split = ev.index(("post", "bwd_kv"))
    names = [f"{g.first_rank}+{g.size}:" for g in layout.groups if g.size > 1]
    for phase, chan in ((ev[:split], "fwd_kv"), (ev[split:], "bwd_kv")):
        last_full = max(i for i, e in enumerate(phase) if e[0] in ("post", "wait")
                        and ":" not in e[1])
        at = last_full
        for name in names:  # each sub-group ring starts after the previous one ended
            mine = [i for i, e in enumerate(phase) if e[0] in ("post", "wait")
                    and e[1].startswith(name)]
            assert mine and min(mine) > at, (name, phase)
            assert sum(phase[i] == ("post", name + chan) for i in mine) == \
                int(name.split("+")[1][:-1]) - 1
            at = max(mine)
    assert len(names) == 1, names  # world 4: {0,1} or {2,3}; world 2: {0,1}
    nl = layout.num_local_tokens
    for kind, chan in (("fwd", "fwd_kv"), ("bwd", "bwd_kv")):
        if nl:  # the local part ran before any sub-group message
            assert ev.index((kind, nl, True)) < ev.index(("post", names[0] + chan))


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


def check_warm_up(rank, world):
    """The warm-up exchange goes once around every group of the ring (all ranks)."""
    bwd = dist.new_group(list(range(world)))
    prev = (rank - 1) % world
    assert RingComm(dist.group.WORLD).warm_up() == [prev]
    comm = RingComm(dist.group.WORLD, bwd_group=bwd)
    assert comm.warm_up() == [prev, prev] and comm.messages_sent == 2
    if world >= 4:
        try:
            comm.subgroup(0, 2).warm_up()
        except ValueError:
            pass
        else:
            raise AssertionError("warm_up on a sub-group ring must refuse")


def check_host_staged(rank, world):
    """Exchanges staged through host memory (what gloo needs for CUDA tensors): the ring
    gives the same parity, sub-group rings stage too, and a message is taken when posted
    (changing the tensor afterwards does not change what the next rank receives)."""
    comm = RingComm(dist.group.WORLD, host_staging=True)
    assert comm.subgroup(rank - rank % 2, 2).host_staging is True
    assert RingComm(dist.group.WORLD)._stage_device  # gloo: CUDA tensors would be staged
    mine = torch.full((3, 2), float(rank))
    recv = comm.send_recv_async(mine, channel="bwd_dkv")
    _, wire_send, wire_recv, _ = comm._pending["bwd_dkv"]
    assert wire_send is not mine and wire_recv is not recv  # gloo sees host copies only
    mine.fill_(-1.0)
    comm.wait("bwd_dkv")
    assert (recv == float((rank - 1) % world)).all(), recv
    with fake_backend("fake_aten:2.13") as kernel:
        run_case("mixed_gqa", rank, world, kernel=kernel,
                 comm_factory=lambda: RingComm(dist.group.WORLD, host_staging=True))
    run_case("grouped", rank, world,
             comm_factory=lambda: RingComm(dist.group.WORLD, host_staging=True))


@contextlib.contextmanager
def fake_streams(log):
    """Recording fake CUDA streams for every device (this worker process only)."""
    from skrull_ext.attention import function, streams

    saved = streams._PROVIDER, streams._STREAMS, function._take_local
    fake = fakes.FakeStreams(log)

    def take_local(dsts, srcs):
        log.append(("merge", len(dsts)))
        saved[2](dsts, srcs)

    streams._PROVIDER, streams._STREAMS, function._take_local = (lambda d: fake), {}, take_local
    try:
        yield fake
    finally:
        streams._PROVIDER, streams._STREAMS, function._take_local = saved


class StreamKernel(RecordingKernel):
    """Records ``(kind, queries, causal, current stream)``."""

    def __init__(self, inner, rec, fake):
        super().__init__(inner, rec)
        self.fake = fake

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        self.rec.events.append(("fwd", q.shape[0], causal, self.fake.current(q.device).name))
        return self.inner.forward(q, k, v, cu_q, cu_k, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        self.rec.events.append(("bwd", q.shape[0], causal, self.fake.current(q.device).name))
        return self.inner.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=scale)


def _assert_order(ev, *marks):
    """Each mark (an event, or a predicate) occurs after the previous one."""
    at = -1
    for mark in marks:
        hit = [i for i, e in enumerate(ev) if i > at and (mark(e) if callable(mark) else e == mark)]
        assert hit, f"{mark} not found after event {at}: {ev}"
        at = hit[0]


def check_stream_order_flash(rank, world):
    """Our ring over the fake flash-attn: post, local kernel on the side stream, join, merge."""
    rec = _Recorder()
    with fake_backend("fake_flash:2.8.3"), fake_streams(rec.events) as fake:
        kernel = StreamKernel(get_kernel("flash", torch.device("cpu"), torch.float64), rec, fake)
        layout = run_case("mixed", rank, world, kernel=kernel,
                          comm_factory=lambda: RecordingComm(RingComm(dist.group.WORLD), rec))
        side = fake.created[0].name
    nl, ev = layout.num_local_tokens, rec.events
    split = ev.index(("post", "bwd_kv"))
    for kind, chan, phase in (("fwd", "fwd_kv", ev[:split]), ("bwd", "bwd_kv", ev[split:])):
        if nl:
            _assert_order(phase, ("post", chan), ("wait_stream", side, "main"), ("enter", side),
                          (kind, nl, True, side), ("exit", side), ("wait_stream", "main", side),
                          ("record_stream", "main"), lambda e: e[0] == "merge")
        calls = [e for e in phase if e[0] == kind]
        assert [e for e in calls if e[3] == side] == ([(kind, nl, True, side)] if nl else [])
        assert sum(e[3] == "main" for e in calls) == world, calls  # one ring block per step


def check_stream_order_te(rank, world):
    """TE's ring posts first; the local part runs on our side stream (not TE's cp_stream),
    joined before the merge, in forward and backward."""
    rec = _Recorder()
    ev = rec.events
    with fake_streams(ev) as fake:
        layout = run_case("mixed_fake_te", rank, world, log=ev)
        side, te_cp = {s.name for s in fake.created}, None
    ev = rec.events
    sets = [e for e in ev if e[0] == "te_set_cp_group"]
    assert len(sets) == 1 and sets[0][2] == "p2p" and sets[0][3] == tuple(range(world)), sets
    te_cp = sets[0][1]
    (side,) = side - {te_cp} if layout.num_local_tokens else ("(none)",)
    assert te_cp not in ("main", side)
    assert ("te_forward", "cp", "main") in ev
    if layout.num_local_tokens:
        _assert_order(ev, ("te_post", "fwd"), ("te_forward", "local", side),
                      ("wait_stream", "main", side), ("record_stream", "main"),
                      lambda e: e[0] == "merge", ("te_post", "bwd"), ("enter", side),
                      ("wait_stream", "main", side), lambda e: e[0] == "merge")


_SYNC_CALLS = ((torch, "tensor"), (torch, "as_tensor"), (torch, "from_numpy"),
               (torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"),
               (torch.Tensor, "numpy"), (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"),
               (torch.Tensor, "__float__"))


@contextlib.contextmanager
def count_host_syncs():
    """Counts host syncs / tensors-from-lists made directly by ``skrull_ext`` code (mocks
    of the torch functions that do them; calls from torch or the fakes are not counted)."""
    counts = collections.Counter()

    def counting(owner, name, orig):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("skrull_ext"):
                counts[f"{caller}.{name}"] += 1
            return orig(*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        for owner, name in _SYNC_CALLS:
            stack.enter_context(mock.patch.object(owner, name,
                                                  counting(owner, name, getattr(owner, name))))
        yield counts


def check_no_host_sync(rank, world):
    """After the first layer built the layout's metadata, further layers (forward and
    backward) make no host sync and build no tensor from a list, for every kernel."""
    from skrull_ext.attention.kernels import segments

    with count_host_syncs() as counts:
        segments((0, 3), torch.device("cpu"))  # the mock sees skrull_ext's calls
    assert counts, "the counting mock saw nothing"
    lengths, distributed, local = placement("mixed", world)
    for backend in ("torch", "fake_flash:2.8.3", "fake_te:2.9"):
        log = []
        layout = build_rank_layout(lengths, distributed, local, rank, world)
        qs, ks, vs, _ = _inputs(lengths, 4, 2, 8, seed=5)
        q, k, v = (layout.pack(t).requires_grad_() for t in (qs, ks, vs))
        with fake_backend(backend, log) as name:
            for layer in range(3):  # layer 0 builds the metadata
                with count_host_syncs() if layer else contextlib.nullcontext() as counts:
                    out = dacp_attention(q, k, v, layout, dist.group.WORLD, backend=name)
                    out.sum().backward()
                if layer:
                    assert not counts, f"{backend}: {dict(counts)}"
        assert not [e for e in log if e[0] == "host_sync"], log


FAKE_CHECKS = {"stream_order_flash": check_stream_order_flash,
               "stream_order_te": check_stream_order_te, "no_host_sync": check_no_host_sync}


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
            elif name == "warm_up":
                check_warm_up(rank, world)
            elif name == "grouped_order":
                check_grouped_order(rank, world)
            elif name == "host_staged":
                check_host_staged(rank, world)
            elif name in FAKE_CHECKS:
                FAKE_CHECKS[name](rank, world)
            else:
                run_case(name, rank, world)
            results[name] = "ok"
        except Exception:  # reported per case; the other cases still run
            results[name] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
