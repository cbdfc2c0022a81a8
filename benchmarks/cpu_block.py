"""A tiny transformer for CPU micro-runs (``calibrate_cpu.py``, ``validate_cpu_sim.py``).

The model follows a :class:`~skrull_ext.costmodel.model.ModelSpec` (pre-norm GQA attention with QKV
bias, SwiGLU MLP, untied output layer) so that its FLOPs are exactly what the cost model
counts.  Attention is computed per document with ``torch.nn.functional.
scaled_dot_product_attention(is_causal=True)``, which on CPU dispatches to ATen's flash
kernel (``_scaled_dot_product_flash_attention_for_cpu``); no cross-document attention.
Timings are the minimum over repeats: the machine is shared, and the minimum is the best
estimate of the uncontended time.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

import dataclasses

from skrull_ext.costmodel.model import CommModel, ModelSpec
from skrull_ext.costmodel.hardware import CPU

# The model of the kernel-level calibration (small enough for 2 cores).
TINY_SPEC = ModelSpec(name="tiny-cpu", num_layers=2, hidden_size=256, ffn_hidden_size=704,
                      num_attention_heads=4, num_query_groups=2, vocab_size=2048)

# The tiny model's own constants, fitted by calibrate_cpu.py on the development machine
# (2026-11-22, one process, 1 thread, fp32; see docs/planner.md).  The ``cpu`` preset
# itself is fitted to the launcher's training iterations (calibrate_training_cpu.py),
# whose per-layer framework cost this bare model does not have.
TINY_CPU = dataclasses.replace(
    CPU, name="cpu-tiny-model", peak_flops=101.9e9, linear_efficiency=1.0,
    linear_half_tokens=0.0, attention_efficiency=0.980, attention_half_tokens=219.0,
    attention_call_overhead_s=150e-6, layer_overhead_s=2448e-6, micro_batch_overhead_s=0.0,
    step_overhead_s=0.0,
    intra_node_comm=CommModel(sizes_bytes=(65536.0, 262144.0, 1048576.0, 4194304.0,
                                           16777216.0),
                              seconds=(97.9e-6, 97.9e-6, 211.5e-6, 1144.4e-6, 5010.6e-6)))


class Layer(torch.nn.Module):
    """One pre-norm transformer layer over a packed ``[T, h]`` batch of documents."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, kv, f = spec.hidden_size, spec.kv_hidden_size, spec.ffn_hidden_size
        self.heads, self.groups = spec.num_attention_heads, spec.num_query_groups
        self.dim = spec.head_dim
        self.norm1, self.norm2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, h + 2 * kv)
        self.proj = torch.nn.Linear(h, h, bias=False)
        self.fc1 = torch.nn.Linear(h, 2 * f, bias=False)
        self.fc2 = torch.nn.Linear(f, h, bias=False)

    def attention(self, q, k, v, doc_lens: Sequence[int]) -> torch.Tensor:
        """Causal attention per document. ``q: [T, H, D]``, ``k, v: [T, G, D]`` -> ``[T, H*D]``."""
        outs, start = [], 0
        rep = self.heads // self.groups
        for s in doc_lens:
            qs = q[start:start + s].transpose(0, 1).unsqueeze(0)
            ks = k[start:start + s].transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0)
            vs = v[start:start + s].transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            outs.append(o.squeeze(0).transpose(0, 1).reshape(s, -1))
            start += s
        return torch.cat(outs, 0)

    def forward(self, x: torch.Tensor, doc_lens: Sequence[int]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.dim, self.groups * self.dim, self.groups * self.dim], dim=-1)
        a = self.attention(q.view(t, self.heads, self.dim), k.view(t, self.groups, self.dim),
                           v.view(t, self.groups, self.dim), doc_lens)
        x = x + self.proj(a)
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class TinyModel(torch.nn.Module):
    """Embedding, ``spec.num_layers`` layers, final norm, output layer, summed token loss."""

    def __init__(self, spec: ModelSpec = TINY_SPEC):
        super().__init__()
        self.spec = spec
        self.embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = torch.nn.ModuleList(Layer(spec) for _ in range(spec.num_layers))
        self.norm = torch.nn.RMSNorm(spec.hidden_size)
        self.out = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, doc_lens: Sequence[int]) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, doc_lens)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits[:-1], tokens[1:], reduction="sum")


def best_time(fn: Callable[[], None], repeats: int = 5, warmup: int = 1) -> float:
    """Minimum wall-clock seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_times(fns: Sequence[Callable[[], None]], repeats: int = 5, warmup: int = 1
               ) -> list[float]:
    """Like :func:`best_time` for several closures, run round-robin.

    Interleaving spreads every closure's repeats over the whole measurement window, so a
    burst of load from other processes cannot spoil all repeats of one of them.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def micro_batch_step(model: TinyModel, doc_lens: Sequence[int], gen: torch.Generator):
    """A closure running forward + backward of one packed micro-batch of ``doc_lens``."""
    tokens = torch.randint(0, model.spec.vocab_size, (int(sum(doc_lens)),), generator=gen)
    lens = [int(s) for s in doc_lens]

    def run():
        model.zero_grad(set_to_none=True)
        model(tokens, lens).backward()

    return run
