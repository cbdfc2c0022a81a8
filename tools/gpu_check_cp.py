"""The CP=2 sections of ``tools/check_gpu.py`` that run inside a torchrun group of 2.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/gpu_check_cp.py \
        attention torch            # DACP parity at world 2 + the side stream's order
    ... tools/gpu_check_cp.py timing torch   # DACP time, side stream on/off (2 GPUs)

With fewer GPUs than ranks the ranks share a GPU over gloo and our ring stages its messages
through host memory (function, not speed: no timing then); with one GPU per rank NCCL.
Rank 0 prints one JSON line per result.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from skrull_ext.attention import ReferenceKernel, RingComm, dacp_attention, get_kernel  # noqa: E402
from skrull_ext.attention import function, streams  # noqa: E402
from skrull_ext.attention.kernels import AttentionKernel  # noqa: E402
from skrull_ext.attention.layout import build_rank_layout  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
#: The world-2 parity micro-batch: 10 local documents, 3 distributed (one not a multiple of 4).
LENGTHS = [200 + 113 * i for i in range(10)] + [3000, 1999, 33]
DISTRIBUTED = [10, 11, 12]
TOLERANCE = {"out": 2e-2, "grad": 4e-2}  # bf16, as section 1


def init() -> tuple[int, int, torch.device, str]:
    """``(rank, world, device, backend)``; gloo when ranks share a GPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local, gpus = int(os.environ.get("LOCAL_RANK", rank)), torch.cuda.device_count()
    backend = "nccl" if gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", world)) else "gloo"
    torch.cuda.set_device(local % gpus)
    # A short timeout: a rank that failed makes its peer fail soon, not hang the section.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    return rank, world, torch.device("cuda", local % gpus), backend


def layouts(world: int):
    local = [[i for i in range(len(LENGTHS)) if i not in DISTRIBUTED and i % world == r]
             for r in range(world)]
    return [build_rank_layout(LENGTHS, DISTRIBUTED, local, r, world) for r in range(world)]


def _inputs(device):
    """Per-sample float64 q, k, v and output weights (same seeds on every rank)."""
    g = torch.Generator().manual_seed(11)
    mk = lambda n, h: torch.randn(n, h, HEAD_DIM, generator=g, dtype=torch.float64)  # noqa: E731
    return [[mk(n, h).to(device) for n in LENGTHS] for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]


def _reference(qs, ks, vs, ws):
    """Per-sample float64 output and dq/dk/dv of whole-document causal attention."""
    ref, scale, res = ReferenceKernel(), 1 / math.sqrt(HEAD_DIM), []
    for q, k, v, w in zip(qs, ks, vs, ws):
        cu = (0, q.shape[0])
        o, lse = ref.forward(q, k, v, cu, cu, causal=True, scale=scale)
        res.append((o, ref.backward(w, q, k, v, o, lse, cu, cu, causal=True, scale=scale)))
    return res


def _run(layout, inputs, group, kernel, comm=None):
    """``(out, (dq, dk, dv))`` of this rank's packed stream in bf16 (loss = sum(out * w))."""
    qs, ks, vs, ws = inputs
    leaves = [layout.pack(t).to(torch.bfloat16).requires_grad_() for t in (qs, ks, vs)]
    out = dacp_attention(*leaves, layout, group, backend=kernel, comm=comm)
    (out.double() * layout.pack(ws)).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _errors(layout, out, grads, want) -> dict:
    """max |err| / max |ref| over this rank's real tokens, outputs and gradients."""
    real = ~layout.is_padding.to(out.device)
    per = {s: w for s, w in zip(range(len(LENGTHS)), want)}
    ref_out = layout.pack([per[s][0] for s in range(len(LENGTHS))])
    err = {"out": _rel(out[real], ref_out[real])}
    for i, name in enumerate(("dq", "dk", "dv")):
        ref = layout.pack([per[s][1][i] for s in range(len(LENGTHS))])
        err[name] = _rel(grads[i][real], ref[real])
    return err


def _rel(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12))


def attention_parity(rank, world, device, kernel) -> dict:
    """World-2 DACP (host-staged ring over gloo on one GPU) against float64 and against one
    process (the same micro-batch at CP=1, bf16, this kernel); side stream on and off."""
    inputs = _inputs(device)
    want = _reference(*inputs)
    mine = layouts(world)[rank]
    out, grads = _run(mine, inputs, dist.group.WORLD, kernel)
    res = {"kernel": kernel, "vs_fp64": _errors(mine, out, grads, want)}
    solo = build_rank_layout(LENGTHS, [], [list(range(len(LENGTHS)))], 0, 1)
    s_out, s_grads = _run(solo, inputs, None, kernel)
    outs, grads_by = solo.unpack(s_out), [solo.unpack(g) for g in s_grads]
    per_sample = [(outs[s], [g[s] for g in grads_by]) for s in range(len(LENGTHS))]
    res["vs_one_process"] = _errors(mine, out, grads, per_sample)
    os.environ[streams.SIDE_STREAM_ENV] = "0"
    try:
        off, _ = _run(mine, inputs, dist.group.WORLD, kernel)
    finally:
        del os.environ[streams.SIDE_STREAM_ENV]
    res["side_stream_off_max_diff"] = float((off.float() - out.float()).abs().max())
    return res


class _RecStream:
    """A real CUDA stream that logs ``wait_stream`` by name."""

    def __init__(self, name, inner, log):
        self.name, self.inner, self.log = name, inner, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))
        self.inner.wait_stream(other.inner)


class RecordingCudaStreams(streams.CudaStreams):
    """``CudaStreams`` on real CUDA streams, logging every operation the attention does."""

    def __init__(self, device, log):
        self.log, self.created = log, []
        self.main = _RecStream("main", torch.cuda.current_stream(device), log)

    def new_stream(self, device):
        s = _RecStream(f"stream{len(self.created) + 1}", torch.cuda.Stream(device=device),
                       self.log)
        self.created.append(s)
        return s

    def current(self, device):
        cur = torch.cuda.current_stream(device)
        return next((s for s in [self.main] + self.created if s.inner == cur), self.main)

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("enter", stream.name))
        with torch.cuda.stream(stream.inner):
            yield
        self.log.append(("exit", stream.name))

    def record(self, tensor, stream):
        self.log.append(("record_stream", stream.name))
        tensor.record_stream(stream.inner)


class _LogKernel(AttentionKernel):
    """Logs ``(kind, queries, causal, stream the call really ran on)``."""

    def __init__(self, inner, rec, log):
        self.inner, self.rec, self.log = inner, rec, log

    def _on(self, q):
        return self.rec.current(q.device).name

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        self.log.append(("fwd", q.shape[0], causal, self._on(q)))
        return self.inner.forward(q, k, v, cu_q, cu_k, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        self.log.append(("bwd", q.shape[0], causal, self._on(q)))
        return self.inner.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=scale)


class _LogComm:
    """Logs the ring's posts and waits."""

    def __init__(self, inner, log):
        self.inner, self.log, self.rank, self.size = inner, log, inner.rank, inner.size

    def send_recv_async(self, send, *, channel="fwd_kv"):
        self.log.append(("post", channel))
        return self.inner.send_recv_async(send, channel=channel)

    def wait(self, channel="fwd_kv"):
        self.log.append(("wait", channel))
        self.inner.wait(channel)


def stream_order(rank, world, device, kernel, make_streams=RecordingCudaStreams) -> dict:
    """On real CUDA streams: post the first exchange, run the local part on the side
    stream, join (wait_stream + record_stream), then merge; forward and backward.
    ``make_streams(device, log)`` builds the recording stream API (tests: a CPU fake)."""
    log: list = []
    rec = make_streams(device, log)
    saved = streams._PROVIDER, streams._STREAMS, function._take_local

    def take_local(dsts, srcs):
        log.append(("merge", len(dsts)))
        saved[2](dsts, srcs)

    streams._PROVIDER, streams._STREAMS, function._take_local = (lambda d: rec), {}, take_local
    try:
        mine = layouts(world)[rank]
        _run(mine, _inputs(device), dist.group.WORLD,
             _LogKernel(get_kernel(kernel, device, torch.bfloat16), rec, log),
             comm=_LogComm(RingComm(dist.group.WORLD), log))
    finally:
        streams._PROVIDER, streams._STREAMS, function._take_local = saved
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"kernel": kernel, "problems": order_problems(log, mine.num_local_tokens, world),
            "events": [list(e) for e in log[:40]]}


def order_problems(log, nl: int, world: int) -> list[str]:
    """What is out of order in ``log`` (empty when the overlap is as designed)."""
    problems, side = [], "stream1"
    split = log.index(("post", "bwd_kv")) if ("post", "bwd_kv") in log else len(log)
    for kind, chan, phase in (("fwd", "fwd_kv", log[:split]), ("bwd", "bwd_kv", log[split:])):
        marks = [("post", chan), ("wait_stream", side, "main"), ("enter", side),
                 (kind, nl, True, side), ("exit", side), ("wait_stream", "main", side),
                 ("record_stream", "main"), "merge"]
        at = -1
        for mark in marks:
            hit = [i for i, e in enumerate(phase) if i > at and (
                e[0] == mark if isinstance(mark, str) else tuple(e) == mark)]
            if not hit:
                problems.append(f"{kind}: {mark} missing after event {at}")
                break
            at = hit[0]
        ring = [e for e in phase if e[0] == kind and e[3] == "main"]
        if len(ring) != world:
            problems.append(f"{kind}: {len(ring)} ring blocks on the main stream, want {world}")
    return problems


def timing(rank, world, device, kernel, repeats: int = 10) -> list[dict]:
    """DACP fwd+bwd time of a mixed micro-batch, side stream on and off (slowest rank)."""
    lengths = [32768] + [256 + (i * 389) % 945 for i in range(48)]
    local = [[i for i in range(1, 49) if i % world == r] for r in range(world)]
    layout = build_rank_layout(lengths, [0], local, rank, world)
    x = [torch.randn(layout.num_tokens, h, HEAD_DIM, device=device, dtype=torch.bfloat16
                     ).requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS)]
    rows = []
    for side in ("1", "0"):
        os.environ[streams.SIDE_STREAM_ENV] = side
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
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append({"kernel": kernel, "side_stream": side == "1", "ms": float(t)})
    return rows


def main(argv=None) -> int:
    what, kernel = (argv if argv is not None else sys.argv[1:])[:2]
    rank, world, device, backend = init()
    try:
        if what == "attention":
            res = {"backend": backend, "world": world, **attention_parity(rank, world, device,
                                                                          kernel)}
            res["stream_order"] = stream_order(rank, world, device, kernel)
            gathered = [None] * world
            dist.all_gather_object(gathered, res)
            if rank == 0:
                print(json.dumps({"ranks": gathered}), flush=True)
        elif what == "timing":
            rows = timing(rank, world, device, kernel)
            if rank == 0:
                print(json.dumps({"rows": rows}), flush=True)
        else:
            raise SystemExit(f"unknown section {what!r}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
