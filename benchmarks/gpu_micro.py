"""Kernel-level runs of the cost model's terms on one device (``calibrate_gpu.py``).

* **dense**: one transformer layer without its core attention (:class:`cpu_block.Layer`:
  RMSNorms, QKV with bias, output projection, SwiGLU MLP) and the LM head with its
  cross-entropy, forward + backward on ``[T, h]`` tokens; the slopes in ``T`` give the
  seconds per token of the dense part, ``c_linear`` over :meth:`ModelSpec.linear_flops`.
* **attention**: the run's attention kernel (``--skrull-attention-kernel``, through
  :func:`skrull_ext.attention.get_kernel`), forward + backward of one layer, on packs of
  ``k`` whole documents of ``S`` tokens, and on the zigzag shards a distributed document
  becomes at CP ``N``: :func:`skrull_ext.attention.ring.ring_forward` / ``ring_backward``
  of one CP rank with a loopback communicator (every block and merge that rank computes,
  no communication), ranks 0 and ``N - 1``, the slower kept.  Without a CUDA kernel (no
  kernel library and no PyTorch CUDA kernel yet) ``torch.nn.functional.
  scaled_dot_product_attention`` runs per document and per ring block instead (autograd,
  no merges).  Per document ``t = c_attention F (1 + S_half / B) / N + call N`` is fitted,
  ``F`` the cost model's attention FLOPs of one layer, ``B`` the query block (``S``, or the
  rank's shard ``pad(S) / N``): exactly :meth:`TimeModel.shard_time` per layer.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from cpu_block import Layer
from calibrate_cpu import nonneg_lstsq

from skrull_ext.costmodel.model import ModelSpec
from skrull_ext.sharding import padded_length, shard_tokens


def dense_runs(spec: ModelSpec, tokens, device, dtype) -> tuple[list, list]:
    """Closures ``(layer runs, LM head runs)``, one per token count, forward + backward."""
    layer = Layer(spec).to(device=device, dtype=dtype)
    head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False).to(device, dtype)
    h = spec.hidden_size

    def layer_step(x):
        y = x + layer.proj(layer.qkv(layer.norm1(x))[:, :h])
        gate, up = layer.fc1(layer.norm2(y)).chunk(2, dim=-1)
        (y + layer.fc2(F.silu(gate) * up)).float().sum().backward()

    def head_step(x, labels):
        F.cross_entropy(head(x).float(), labels).backward()

    layers, heads = [], []
    for t in tokens:
        x = torch.randn(t, h, device=device, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, spec.vocab_size, (t,), device=device)
        layers.append(lambda x=x: layer_step(x))
        heads.append(lambda x=x, labels=labels: head_step(x, labels))
    return layers, heads


def fit_dense(spec: ModelSpec, tokens, layer_t, head_t) -> dict:
    """Seconds per token of one layer's dense part and of the head; ``c_linear`` of them."""
    t = np.asarray(tokens, dtype=np.float64)
    a = np.stack([t, np.ones_like(t)], 1)
    l1, l0 = nonneg_lstsq(a, np.asarray(layer_t))
    h1, h0 = nonneg_lstsq(a, np.asarray(head_t))
    per_token = spec.num_layers * l1 + h1
    return {"layer_seconds_per_token": float(l1), "layer_fixed_seconds": float(l0),
            "head_seconds_per_token": float(h1), "head_fixed_seconds": float(h0),
            "model_seconds_per_token": float(per_token),
            "c_linear": float(per_token / spec.linear_flops_per_token()),
            "tflops": float(spec.linear_flops_per_token() / per_token / 1e12)}


class LoopbackComm:
    """Rank ``rank`` of an ``size``-rank ring that receives what it sends: the ring code
    runs every block and merge of that rank without moving a byte (compute only)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def send_recv_async(self, tensor, channel: str = "fwd_kv"):
        del channel
        return tensor

    def wait(self, channel: str = "fwd_kv") -> None:
        del channel


def _qkv(spec: ModelSpec, tokens: int, device, dtype):
    d = spec.head_dim
    q = torch.randn(tokens, spec.num_attention_heads, d, device=device, dtype=dtype)
    k, v = (torch.randn(tokens, spec.num_query_groups, d, device=device, dtype=dtype)
            for _ in range(2))
    return q, k, v, torch.randn_like(q), 1.0 / math.sqrt(d)


def kernel_run(kernel, spec: ModelSpec, length: int, docs: int, cp: int, rank: int,
               device, dtype) -> Callable[[], None]:
    """Forward + backward of ``docs`` documents of ``length`` tokens on CP rank ``rank`` of
    ``cp`` (``cp == 1``: whole documents, one varlen call each way)."""
    from skrull_ext.attention.kernels import segments
    from skrull_ext.attention.layout import DistributedDoc
    from skrull_ext.attention.ring import blocks_of, ring_backward, ring_forward

    if cp == 1:
        seg = segments([i * length for i in range(docs + 1)], device)
        q, k, v, dout, scale = _qkv(spec, docs * length, device, dtype)

        def run():
            out, lse = kernel.forward(q, k, v, seg, seg, causal=True, scale=scale)
            kernel.backward(dout, q, k, v, out, lse, seg, seg, causal=True, scale=scale)
        return run
    pad = padded_length(length, cp)
    c = pad // (2 * cp)
    shard = [DistributedDoc(sample=i, length=length, padded_length=pad, chunk_size=c,
                            offset=2 * c * i, shard_length=2 * c) for i in range(docs)]
    zz = blocks_of(shard, [2 * c * i for i in range(docs + 1)], device)
    q, k, v, dout, scale = _qkv(spec, docs * 2 * c, device, dtype)
    comm = LoopbackComm(rank, cp)

    def run():
        out, lse = ring_forward(q, k, v, zz, comm, kernel, scale)
        ring_backward(dout, q, k, v, out, lse, zz, comm, kernel, scale)
    return run


def sdpa_run(spec: ModelSpec, length: int, docs: int, cp: int, rank: int, device,
             dtype) -> Callable[[], None]:
    """The fallback: ``scaled_dot_product_attention`` per document and ring block, forward
    + backward through autograd (rank 0 runs its causal block then ``N - 1`` blocks of its
    second chunk against a whole shard; rank ``N - 1`` both chunks against a first chunk).
    K/V come with every query head (same FLOPs as GQA), so SDPA's flash back-end takes
    them on any torch release."""
    c = padded_length(length, cp) // (2 * cp) if cp > 1 else length
    d, h = spec.head_dim, spec.num_attention_heads

    def t(heads, n):
        return torch.randn(1, heads, n, d, device=device, dtype=dtype, requires_grad=True)

    if cp == 1:
        blocks = [(length, length, True)]
    else:
        rest = (c, 2 * c) if rank == 0 else (2 * c, c)
        blocks = [(2 * c, 2 * c, True)] + [(*rest, False)] * (cp - 1)
    work = [(t(h, nq), t(h, nk), t(h, nk), causal) for nq, nk, causal in blocks] * docs

    def run():
        for q, k, v, causal in work:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).float().sum().backward()
    return run


def attention_cases(lengths, cp_sizes, pack_tokens: int, max_docs: int = 256) -> list[dict]:
    """``{cp, length, docs, rank}`` cases: whole documents of every length packed to about
    ``pack_tokens`` (at most ``max_docs``), and every length but the shortest sharded over
    each CP size (ranks 0 and ``N - 1``; the scheduler distributes long documents)."""
    def docs(tokens):
        return int(min(max_docs, max(1, pack_tokens // tokens)))

    cases = [dict(cp=1, length=s, docs=docs(s), rank=0) for s in lengths]
    for n in cp_sizes:
        for s in sorted(lengths)[1:]:
            if s >= 4 * n:
                cases += [dict(cp=n, length=s, docs=docs(shard_tokens(s, n)), rank=r)
                          for r in (0, n - 1)]
    return cases


def attention_runs(kernel, spec, cases, device, dtype) -> list[Callable[[], None]]:
    """One closure per case: ``kernel``'s (an ``AttentionKernel``), or SDPA's when ``None``."""
    if kernel is None:
        return [sdpa_run(spec, c["length"], c["docs"], c["cp"], c["rank"], device, dtype)
                for c in cases]
    return [kernel_run(kernel, spec, c["length"], c["docs"], c["cp"], c["rank"], device, dtype)
            for c in cases]


def fit_attention(spec: ModelSpec, cases, seconds) -> dict:
    """Fits ``c_attention``, ``attention_half_tokens`` and ``attention_call_overhead`` (per
    document or ring block, and layer) to per-document times, the slower rank per shard."""
    rows: dict = {}
    for case, t in zip(cases, seconds):
        if t is not None:
            key = (case["cp"], case["length"])
            rows[key] = max(rows.get(key, 0.0), t / case["docs"])
    if len(rows) < 3:
        raise ValueError(f"attention fit needs >= 3 measured cases, got {len(rows)}")
    keys = sorted(rows)
    x, y = [], np.array([rows[k] for k in keys])
    for n, s in keys:
        flops = spec.attention_flops_coef() * float(s) ** 2 / n
        block = float(s if n == 1 else shard_tokens(s, n))
        x.append([flops, flops / block, float(n)])
    coef = nonneg_lstsq(np.asarray(x), y)
    half = float(coef[1] / coef[0]) if coef[0] > 0 else 0.0
    pred = np.asarray(x) @ coef
    table = [{"cp": n, "length": s, "seconds_per_document": float(m), "predicted": float(p),
              "tflops": float(xx[0] / m / 1e12)}  # this rank's FLOPs / its time
             for (n, s), m, p, xx in zip(keys, y, pred, x)]
    return {"c_attention": float(coef[0]), "attention_half_tokens": half,
            "attention_call_overhead": float(coef[2]), "rows": table,
            "max_abs_pct": float(100 * np.max(np.abs(pred / y - 1.0)))}


def resolve_kernel(name: str, device, dtype):
    """``(AttentionKernel or None, label)``: the run's kernel, or ``None`` (SDPA fallback)
    with the reason, when it does not resolve to a block kernel on ``device``."""
    from skrull_ext.attention import get_kernel
    from skrull_ext.attention.kernels import AttentionKernel

    if name == "sdpa":
        return None, "sdpa (asked for)"
    try:
        kernel = get_kernel(name, device, dtype)
    except (RuntimeError, ValueError) as exc:
        return None, f"sdpa (fallback: {exc})"
    if not isinstance(kernel, AttentionKernel):  # Transformer Engine runs its own ring
        return None, f"sdpa (fallback: {getattr(kernel, 'name', name)} has no block kernel)"
    return kernel, kernel.name

