"""Host (CPU) time of TransformerEngine's THD p2p context-parallel ring, from TE's own source.

Megatron-LM's dynamic-CP example (``benchmarks/megatron_dynamic_cp.py``) runs attention
through TE's ``attn_forward_func_with_cp`` (``AttnFuncWithCPAndKVP2P``: ``qkv_format='thd'``,
``padding_causal``, the FlashAttention backend, bf16, no FP8).  TE cannot be installed here,
so this loads TE's ``context_parallel.py`` (a file of a TE checkout, ``--te-file``) with every
dependency it imports replaced by a stub, and runs its forward and backward on tiny CPU
tensors for each ring size ``N`` and every CP rank:

* what TE's Python runs per ring step is counted, not guessed: aten ops (through a
  ``TorchDispatchMode``: kernels, views, allocations), calls of TE's CUDA extension
  (``tex.thd_*``), flash-attn calls, NCCL ``isend``/``irecv``, request waits and stream /
  event calls (stub counters);
* its host time is measured on this CPU: the floor of the real thing, which also pays one
  CUDA launch per kernel, the NCCL calls' host work and the flash-attn wrappers' dispatch.

Stubs (ours, not TE's): each ``tex.thd_*`` call and each flash-attn kernel is one CPU torch
op on an output of the right shape (flash-attn forward: 3 allocations + 1 op; backward: 2
allocations + 3 ops, one per kernel of flash-attn 2's varlen backward); streams, events and
``isend``/``irecv`` are no-op objects; ``jit_fuser`` is the identity (TE wraps its softmax
corrections in ``torch.compile``: one fused kernel behind a guard check instead of ~6 eager
ops).  The fit ``host(N) = fixed + per_step x N`` over the ``--cp`` sizes from 4 (TE batches
CP 2's exchange below sm100) gives the cost of one more ring step.

    F=transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py
    git -C TE show v2.12:$F > /tmp/cp.py   # TE: a TransformerEngine clone
    PYTHONPATH=. python benchmarks/te_ring_host.py --te-file /tmp/cp.py --te-commit "v2.12 5671fd36"
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import time
import types

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import results_io

COUNTS: collections.Counter = collections.Counter()
ATEN: collections.Counter = collections.Counter()  # kernel-launching aten ops by name
# aten ops that launch no kernel: views and allocations (everything else counts as a kernel).
VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "alias", "detach", "t",
         "transpose", "unsqueeze", "squeeze", "expand", "permute", "split", "unbind",
         "_reshape_alias", "lift_fresh", "_to_copy_noop"}
ALLOCS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
MODULE = "transformer_engine.pytorch.attention.dot_product_attention.context_parallel"


class _Counted:
    """A no-op CUDA stream / event / NCCL request; every call counts."""

    def __init__(self, kind: str):
        self.kind = kind

    def __getattr__(self, name):
        def call(*_a, **_k):
            COUNTS[f"{self.kind}.{name}"] += 1
        return call


class _Group:
    """A CP process group of ``size`` ranks seen from ``rank``."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _tex() -> types.ModuleType:
    """``transformer_engine_torch``: each THD helper is one op (one CUDA kernel in TE)."""
    def counted(name, fn):
        def call(*args):
            COUNTS[f"tex.{name}"] += 1
            return fn(*args)
        return call
    tex = types.ModuleType("transformer_engine_torch")
    tex.thd_read_half_tensor = counted("thd_read_half_tensor",
                                       lambda t, cu, half: t[: t.shape[0] // 2].clone())
    tex.thd_second_half_lse_correction = counted(
        "thd_second_half_lse_correction", lambda lse, step, cu, packed: lse.add_(0.0))
    tex.thd_out_correction = counted("thd_out_correction",
                                     lambda out, step, *rest: out.add_(0.0))
    tex.thd_read_second_half_lse = counted(
        "thd_read_second_half_lse", lambda lse, cu, packed, n: lse[:, :n].clone())
    tex.thd_grad_correction = counted("thd_grad_correction",
                                      lambda g, step, cu, a, b: g.add_(0.0))
    tex.NVTE_Fused_Attn_Backend = types.SimpleNamespace()
    return tex


def _flash_fwd(q, k, v, *args, **kwargs):
    """flash-attn 2.7 ``_flash_attn_varlen_forward``: out, lse [h, t], rng state; 1 kernel."""
    COUNTS["flash_attn.fwd"] += 1
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    rng = torch.empty(2, dtype=torch.int64)
    out.copy_(q)
    return out, lse, None, rng


def _flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, *args, **kwargs):
    """flash-attn 2.7 ``_flash_attn_varlen_backward``: 3 kernels (dot(dO, O), the backward,
    the dQ conversion) into ``dq``, ``dk``, ``dv``."""
    COUNTS["flash_attn.bwd"] += 1
    softmax_d = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32)  # dq_accum
    dq.copy_(q)
    dk.copy_(k)
    dv.copy_(v)
    return softmax_d


def _empty_class(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


class _StubModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``transformer_engine`` module TE's file imports: a package whose unknown names
    are empty classes (import-time names for FP8 paths the bf16 run never takes)."""

    def find_spec(self, name, path, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _empty_class
        return module

    def exec_module(self, module):
        pass


def _install_stubs() -> None:
    """Every module ``context_parallel.py`` imports, as stubs (see the module docstring)."""
    import importlib as _importlib
    if not any(isinstance(f, _StubModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubModules())

    def mod(name, **attrs):
        _importlib.import_module(name).__dict__.update(attrs)
    none = lambda *a, **k: None  # noqa: E731
    fa_utils = types.SimpleNamespace(v2_3_plus=True, v2_4_plus=True, v2_4_1_plus=True,
                                     v2_5_7_plus=True, v2_6_0_plus=True, v2_7_0_plus=True)
    sys.modules["transformer_engine_torch"] = _tex()
    pre = "transformer_engine.pytorch"
    mod(f"{pre}.utils", get_cudnn_version=lambda: (9, 10, 0), nvtx_range_pop=none,
        nvtx_range_push=none, get_device_compute_capability=lambda: (9, 0))
    mod(f"{pre}.cpp_extensions.fused_attn", fused_attn_fwd=none, fused_attn_bwd=none,
        FusedAttnBackend={})
    mod(f"{pre}.quantization", FP8GlobalStateManager=types.SimpleNamespace(
        get_fp8_recipe=none))
    mod(f"{pre}.quantized_tensor", prepare_for_saving=lambda *t: (list(t), [None] * len(t)),
        restore_from_saved=lambda objs, saved, *a: list(saved),
        restore_from_func_ctx=lambda ctx, *a: list(ctx.saved_tensors))
    mod(f"{pre}.jit", jit_fuser=lambda f: f)
    mod(f"{pre}.graph", is_graph_capturing=lambda: False)
    mod(f"{pre}.constants", dist_group_type=_Group, TE_DType={})
    mod(f"{pre}.distributed", get_distributed_world_size=lambda g: g.size(),
        get_distributed_rank=lambda g: g.rank())
    mod(f"{pre}.attention.dot_product_attention.utils", FlashAttentionUtils=fa_utils,
        get_attention_quantizers=lambda fp8, q: (None,) * 6)
    mod(f"{pre}.attention.dot_product_attention.backends",
        _flash_attn_varlen_fwd=_flash_fwd, _flash_attn_varlen_bwd=_flash_bwd)


@contextlib.contextmanager
def _no_cuda():
    """CUDA streams, events and NCCL p2p as counted no-ops while TE's code runs."""
    def p2p(kind):
        def call(*_a, **_k):
            COUNTS[f"nccl.{kind}"] += 1
            return _Counted("request")
        return call
    def batch(ops):
        COUNTS["nccl.batch_isend_irecv"] += 1
        return [_Counted("request") for _ in ops]
    dist = torch.distributed
    names = ("isend", "irecv", "P2POp", "batch_isend_irecv")
    saved = (torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event,
             *(getattr(dist, name) for name in names))
    torch.cuda.current_stream = lambda *a: _Counted("stream")
    torch.cuda.stream = lambda s: (COUNTS.update(["stream.switch"]), contextlib.nullcontext())[1]
    torch.cuda.Event = lambda *a, **k: _Counted("event")
    dist.isend, dist.irecv = p2p("isend"), p2p("irecv")
    dist.P2POp, dist.batch_isend_irecv = lambda *a: a, batch  # CP 2 below sm100 batches
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event = saved[:3]
        for name, value in zip(names, saved[3:]):
            setattr(dist, name, value)


def load_te(path: str):
    """TE's ``context_parallel.py`` at ``path``, imported over the stubs."""
    _install_stubs()
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return module


def ring_call(te, n: int, rank: int, counter=None, seqs: int = 4, per_rank: int = 16) -> tuple:
    """One layer's forward and backward of the THD p2p ring on CP rank ``rank`` of ``n``,
    as TE's FlashAttention backend calls it: ``(forward s, backward s)``; ``counter`` (a
    dispatch mode) sees TE's calls only, not the inputs' creation."""
    t = seqs * per_rank  # local tokens; each sequence 2 n x (per_rank / 2) tokens globally
    q, k, v = (torch.randn(t, 2, 8, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    cu = torch.arange(seqs + 1, dtype=torch.int32) * (per_rank * n)
    dout = torch.ones_like(q)
    with counter or contextlib.nullcontext():
        t0 = time.perf_counter()
        out = te.attn_forward_func_with_cp(
            True, q, k, v, cu, cu, per_rank * n, per_rank * n, cu, cu, 0.0, _Group(n, rank),
            list(range(n)), _Counted("stream"), "p2p", softmax_scale=None, qkv_format="thd",
            attn_mask_type="padding_causal", deterministic=False, window_size=(-1, 0),
            quantizers=None, pad_between_seqs=False, use_flash_attn_3=False, fp8_output=False)
        t1 = time.perf_counter()
        out.backward(dout.view(out.shape))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


class _OpCounter(TorchDispatchMode):
    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kind = "view" if name in VIEWS else "alloc" if name in ALLOCS else "kernel"
        COUNTS[f"aten.{kind}"] += 1
        if kind == "kernel":
            ATEN[name] += 1
        return func(*args, **(kwargs or {}))


def measure(te, n: int, repeats: int) -> dict:
    """Per layer, rank-averaged: counts of one forward + backward, and min host seconds."""
    COUNTS.clear()
    ATEN.clear()
    with _no_cuda():
        for rank in range(n):  # counts: one call per rank under the dispatch counter
            ring_call(te, n, rank, _OpCounter())
        counts = {key: value / n for key, value in sorted(COUNTS.items())}
        kernels = {key: value / n for key, value in ATEN.most_common()}
        fwd, bwd = [], []
        for rank in range(n):
            best = min((ring_call(te, n, rank) for _ in range(repeats)), key=sum)
            fwd.append(best[0])
            bwd.append(best[1])
    return {"cp": n, "counts": counts, "aten_kernels": kernels, "forward_s": float(np.mean(fwd)),
            "backward_s": float(np.mean(bwd))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--te-file", required=True,
                        help="TE's transformer_engine/pytorch/attention/dot_product_attention/"
                             "context_parallel.py")
    parser.add_argument("--te-commit", default="unknown", help="recorded with the results")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    run = results_io.start()
    torch.set_num_threads(1)
    te = load_te(args.te_file)
    rows = [measure(te, n, args.repeats) for n in args.cp]
    # CP 2 exchanges with batch_isend_irecv (TE: below sm100 at CP 2): fit over CP >= 4.
    fitted = [r for r in rows if r["cp"] >= 4] or rows
    x = np.array([r["cp"] for r in fitted], dtype=float)
    fit = {}
    for key in ("forward_s", "backward_s"):
        slope, fixed = np.polyfit(x, [r[key] for r in fitted], 1)
        fit[key] = {"per_step_s": float(slope), "fixed_s": float(fixed)}
    keys = sorted({k for r in fitted for k in r["counts"]})
    step_counts = {k: float(np.polyfit(x, [r["counts"].get(k, 0.0) for r in fitted], 1)[0])
                   for k in keys}
    for r in rows:
        print(f"CP {r['cp']:>2}: forward {r['forward_s'] * 1e6:7.1f} us, backward "
              f"{r['backward_s'] * 1e6:7.1f} us per layer | " +
              ", ".join(f"{k} {v:g}" for k, v in r["counts"].items()))
    print("per ring step (slope over CP): " + ", ".join(
        f"{k} {v['per_step_s'] * 1e6:.1f} us (fixed {v['fixed_s'] * 1e6:.1f})"
        for k, v in fit.items()))
    print("counts per ring step: " + ", ".join(f"{k} {v:.2f}" for k, v in step_counts.items()))
    results_io.record("te_ring_host", {"per_cp": rows, "fit": fit, "per_step_counts":
                                       step_counts}, run, argv, te_commit=args.te_commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
