"""CPU shims for the few Megatron-Core 0.16 paths that assume a CUDA device.

Megatron-Core runs on CPU with a gloo process group except where it hard-codes CUDA.  The
paths our training stack reaches are patched here, in ONE place, by
:func:`apply_cpu_compat`:

* ``torch.cuda.current_device`` -- used as a ``device=`` argument all over mcore (tensor
  parallel mappings, RoPE's ``get_emb`` moving ``inv_freq``, buffers).  On a machine
  without CUDA it can only raise, so the shim returns ``torch.device("cpu")`` instead.
* ``megatron.core.transformer.utils.get_default_causal_mask`` /
  ``get_sliding_window_causal_mask`` -- build their masks with ``device="cuda"``; used by
  the stock ``DotProductAttention`` (our reference model in tests).  The shim builds them
  on CPU.  ``fusions.fused_softmax`` imports them by name, so both bindings are replaced.
* The CUDA RNG tracker (``tensor_parallel.random``) -- ``CudaRNGStatesTracker.add`` and
  ``fork`` and ``_get/_set_cuda_rng_state`` (used by activation checkpointing and
  ``model_parallel_cuda_manual_seed``) read and write the CUDA generator.  The shim makes the
  tracker keep named CPU generator states, so ``model_parallel_cuda_manual_seed`` and
  ``get_cuda_rng_tracker().fork()`` work and still give tensor-parallel ranks separate
  streams.

Scoped, not patched: :func:`cuda_to_cpu` is a context manager (a torch function mode) under
which mcore's ``DistributedDataParallel``, optimizers (``get_megatron_optimizer``, the
distributed optimizer, grad scalers, clipping) and pipeline schedules run on CPU.  Those
hard-code ``device='cuda'`` in tensor factories (``torch.zeros(..., device='cuda')``), call
``Tensor.cuda()`` and check ``param.type() == 'torch.cuda.FloatTensor'``.  Inside the mode
factory calls get ``device='cpu'``, ``.cuda()`` returns the CPU tensor, and ``type()`` of a
CPU tensor reports the CUDA name mcore expects -- float64 reports ``torch.cuda.FloatTensor``
and ``.float()`` keeps float64, because our parity mode (``--fp64``) gives float64 the role
float32 has in mcore (full-precision params and gradients; the distributed optimizer's
``shard_model_grad.float()`` would otherwise cast fp64 gradients down); only in that mode
(:func:`keep_float64`, set by ``build_trainer`` from ``--fp64``), so the fp16 loss scaler's
deliberate ``double().reciprocal().float()`` stays float32.  The training loop enters the mode
around its mcore calls only; nothing outside it changes.

Not patched because our stack never reaches them: RoPE's CP slicing
(``get_pos_emb_on_this_cp_rank``, which also calls ``.cuda()``) -- :mod:`megatron.skrull.model`
builds ``GPTModel`` without RoPE and applies it in its ``core_attention`` from the global
position ids of the packed stream, so ``RotaryEmbedding.forward`` / ``get_emb`` never run.

One shim is for CUDA, not CPU: :func:`apply_gloo_cuda_compat` lets mcore's DDP reduce CUDA
gradients over gloo, for ranks sharing one GPU (see its section).  One is for both:
:func:`foreach_multi_tensor` (scoped to the optimizer step) runs mcore's multi-tensor
fallbacks (no TE, no apex) as torch foreach ops, without a device sync per parameter.

``tests/test_cpu_compat.py`` fails when upstream changes under these shims.
"""
from __future__ import annotations

import contextlib
import queue
import functools
from typing import Any, Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_compat", "apply_gloo_cuda_compat", "cpu_checkpoint_io", "cpu_compat_applied", "cpu_pipeline_p2p",
           "cuda_to_cpu", "foreach_multi_tensor", "resolve_device", "original", "ORIGINALS"]

# name -> object that was replaced (kept so tests can check the upstream behaviour).
ORIGINALS: dict[str, Any] = {}
_APPLIED: tuple[str, ...] = ()


def resolve_device(device: Union[str, torch.device, None] = None) -> torch.device:
    """Maps ``None``/``"auto"`` to ``cuda`` when available else ``cpu``; checks the rest.

    Raises:
        ValueError: ``cuda`` requested on a machine without CUDA, or an unknown device.
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but torch sees no CUDA device; "
                         "use --device cpu (or auto)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use cpu, cuda or auto")
    return dev


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@functools.lru_cache(maxsize=8)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Same mask as upstream (True above the diagonal = masked), on CPU."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq, skv, window_size):
    keep = torch.ones(sq, skv, dtype=torch.bool)
    keep = torch.triu(keep, diagonal=skv - sq - window_size[0])
    keep = torch.tril(keep, diagonal=skv - sq + window_size[1])
    return ~keep


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    """CPU stand-in for ``tensor_parallel.random._get_cuda_rng_state`` (same signature)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False) -> None:
    """CPU stand-in for ``tensor_parallel.random._set_cuda_rng_state`` (same signature)."""
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class(base: type) -> type:
    """Subclass of upstream's ``CudaRNGStatesTracker`` whose named states are CPU states."""

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Named CPU generator states; ``fork(name)`` swaps the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            outer_name = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _patch(owner: Any, attr: str, new: Any, key: str) -> None:
    ORIGINALS.setdefault(key, getattr(owner, attr))
    setattr(owner, attr, new)


def apply_cpu_compat(device: Union[str, torch.device, None] = None) -> tuple[str, ...]:
    """Patches mcore's CUDA-only paths for CPU training; idempotent, no-op on CUDA.

    Args:
        device: Training device (``None``/``"auto"``: CUDA when available).

    Returns:
        Names of the patched objects (empty on CUDA).  Calling again returns the same
        tuple without patching twice.
    """
    global _APPLIED
    if resolve_device(device).type == "cuda":
        return ()
    if _APPLIED:
        return _APPLIED
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as tr_utils

    _patch(torch.cuda, "current_device", _cpu_current_device, "torch.cuda.current_device")
    for module, prefix in ((tr_utils, "transformer.utils"), (fused_softmax, "fused_softmax")):
        _patch(module, "get_default_causal_mask", _cpu_default_causal_mask,
               f"{prefix}.get_default_causal_mask")
        _patch(module, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask,
               f"{prefix}.get_sliding_window_causal_mask")
    _patch(tp_random, "_get_cuda_rng_state", _cpu_get_rng_state, "random._get_cuda_rng_state")
    _patch(tp_random, "_set_cuda_rng_state", _cpu_set_rng_state, "random._set_cuda_rng_state")
    tracker_cls = _make_cpu_tracker_class(tp_random.CudaRNGStatesTracker)
    _patch(tp_random, "CudaRNGStatesTracker", tracker_cls, "random.CudaRNGStatesTracker")
    # A tracker created before the patch holds CUDA semantics: rebuild it as a CPU one.
    tp_random.initialize_rng_tracker(force_reset=True)
    _APPLIED = tuple(sorted(ORIGINALS))
    return _APPLIED


def cpu_compat_applied() -> bool:
    """True once :func:`apply_cpu_compat` has patched this process."""
    return bool(_APPLIED)


def original(name: str) -> Optional[Callable[..., Any]]:
    """The upstream object replaced under ``name`` (see :data:`ORIGINALS`), if patched."""
    return ORIGINALS.get(name)


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float64: "torch.cuda.FloatTensor",
                    torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device to torch
    return device is not None and torch.device(device).type == "cuda"


_KEEP_FLOAT64 = True  # --fp64 parity mode (the default keeps the tests' fp64 runs exact)


def keep_float64(enabled: bool) -> None:
    """Whether ``.float()`` keeps float64 inside :func:`cuda_to_cpu` (``--fp64`` runs)."""
    global _KEEP_FLOAT64
    _KEEP_FLOAT64 = bool(enabled)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects the CUDA device of mcore's factories, ``.cuda()`` and ``type()`` to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if (func is torch.Tensor.float and len(args) == 1 and args[0].dtype == torch.float64
                and _KEEP_FLOAT64):
            return args[0]  # fp64 parity mode: float64 is the "fp32" of mcore's main params
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        elif "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu(device: Union[str, torch.device, None] = "cpu"):
    """Runs mcore's DDP/optimizer/schedule code on CPU inside the block (no-op on CUDA).

    Args:
        device: The training device; the mode is entered only when it is the CPU.
    """
    if resolve_device(device).type != "cpu":
        yield
        return
    with _CudaToCpuMode():
        yield


# --- dist_checkpointing on CPU (scoped: only while a checkpoint is saved or loaded) ----------
#
# mcore's torch_dist writer (``strategies.filesystem_async``) assumes a GPU job:
# * ``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()`` after its
#   (non-blocking) device-to-host copies; a CPU-only torch can only raise there.  On CPU the
#   tensors already are host memory, so there is nothing to wait for.
# * ``write_preloaded_data_multiproc`` forks one writer process per bucket and the results
#   travel through a spawned ``multiprocessing.Manager`` queue.  Forking a trainer that holds
#   gloo and OpenMP threads deadlocks here (measured: the forked writer never finishes), and
#   the Manager re-imports ``__main__``.  On CPU we run the same per-bucket writer
#   (``write_preloaded_data``, upstream's own function) in-process with thread queues.
# Upstream's files, metadata and load path are untouched; tests/test_cpu_compat.py checks
# that upstream still has the code these patches stand in for.

class _DoneQueue(queue.Queue):
    """``JoinableQueue`` stand-in for the in-process writer (``get`` + ``task_done``)."""


def _inprocess_write_multiproc(transform_list, use_msc, rank, write_buckets,
                               global_results_queue) -> None:
    """In-process twin of ``FileSystemWriterAsync.write_preloaded_data_multiproc``."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    results: queue.Queue = queue.Queue()
    out: Any = {}
    for idx, bucket in enumerate(write_buckets):
        done = _DoneQueue()
        done.put(idx)
        FileSystemWriterAsync.write_preloaded_data(transform_list, idx, bucket, results, done,
                                                   True, use_msc=use_msc)
        proc_idx, res = results.get_nowait()
        if isinstance(res, Exception):
            out = res
            break
        out[proc_idx] = res
    global_results_queue.put(out)


@contextlib.contextmanager
def cpu_checkpoint_io(device: Union[str, torch.device, None] = None):
    """Lets ``megatron.core.dist_checkpointing.save/load`` run on CPU inside the block.

    No-op on CUDA.  Patches ``torch.cuda.synchronize`` (no-op), the writer's results queue
    (a thread queue) and its forked multi-process writer (in-process), and restores all
    three on exit, so the rest of the run sees upstream's objects.
    """
    if resolve_device(device).type == "cuda":
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    saved = [(torch.cuda, "synchronize", torch.cuda.synchronize),
             (fsa, "_get_write_results_queue", fsa._get_write_results_queue),
             (fsa.FileSystemWriterAsync, "write_preloaded_data_multiproc",
              fsa.FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"])]
    torch.cuda.synchronize = lambda device=None: None
    fsa._get_write_results_queue = queue.Queue
    fsa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(
        _inprocess_write_multiproc)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


@contextlib.contextmanager
def cpu_pipeline_p2p(device: Union[str, torch.device, None] = "cpu"):
    """mcore's 1F1B schedule on CPU inside the block (no-op on CUDA).

    The schedule runs inside :func:`cuda_to_cpu`, except that
    ``P2PCommunicator._communicate_shapes`` (pipeline stages exchanging the variable
    activation shapes) calls ``torch.cuda.synchronize()``, which no torch function mode
    intercepts and a CPU-only torch can only raise on: a no-op in the block, upstream's
    function again after it.
    """
    if resolve_device(device).type != "cpu":
        yield
        return
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


# --- gloo with CUDA tensors (ranks sharing one GPU: SKRULL_DIST_BACKEND=gloo) -----------------
#
# Two processes on one GPU cannot share an NCCL communicator, so the one-GPU CP checks run
# CUDA ranks over gloo.  gloo's all-reduce, broadcast and all-gather take CUDA tensors
# (staged through pinned host memory), but mcore's DDP reduces gradient buckets inside
# ``torch.distributed._coalescing_manager``, which hands the captured all-reduces to
# ``allreduce_coalesced``: gloo implements that for CPU tensors only ("Invalid backend").
# ``param_and_grad_buffer`` imports the manager by name; in this mode it gets one that lets
# the collectives run one by one, synchronously.  Overlapped reduction (async) is refused at
# startup (megatron.skrull.pretrain_gpt.dist_backend).

class _Done:
    """What the coalescing manager yields: every collective in it has already finished."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _one_by_one_coalescing(group=None, device=None, async_ops: bool = False):
    """Stand-in for ``torch.distributed._coalescing_manager``: no capture, collectives
    inside run eagerly (gloo has no CUDA ``allreduce_coalesced``)."""
    if async_ops:
        raise RuntimeError("overlapped gradient reduction cannot run over gloo with CUDA "
                           "tensors; drop --overlap-grad-reduce / --overlap-param-gather")
    yield _Done()


def apply_gloo_cuda_compat() -> tuple[str, ...]:
    """Lets mcore's DDP reduce CUDA gradients over gloo (idempotent); returns the names of
    the patched objects."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    key = "param_and_grad_buffer._coalescing_manager"
    if buffers._coalescing_manager is not _one_by_one_coalescing:
        _patch(buffers, "_coalescing_manager", _one_by_one_coalescing, key)
    return (key,)


# --- mcore's multi-tensor fallbacks as torch foreach ops (CUDA and CPU; scoped) ------------
#
# Without Transformer Engine or apex, mcore's clipping and its fp16/bf16 optimizer fall back
# to ``megatron.core.utils.local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``
# (bound as ``l2_norm_impl`` / ``multi_tensor_scale_impl`` in ``optimizer.clip_grads`` and
# ``optimizer.optimizer``).  The l2 norm builds ``torch.tensor(list of per-parameter norms)``,
# which reads every norm back to the host: one device sync per parameter (171 per step for
# the Qwen2.5-0.5B shape, measured on an H200), and the scale launches two kernels per
# parameter.  PyTorch's ``torch._foreach_norm`` / ``_foreach_mul_`` / ``_foreach_copy_`` do
# the same arithmetic in a few multi-tensor kernels with nothing read back (on CPU they loop
# over the same per-tensor ops as upstream: bit-identical, tests/test_cpu_compat.py).  With
# TE or apex mcore uses their fused kernels and this changes nothing.

def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm`` without reading the norms back: ``([1] float32 norm
    of all tensors, None)`` on their device."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
    return total.to(torch.float32).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``local_multi_tensor_scale`` (``dst = src * scale``) in foreach kernels."""
    src, dst = tensor_lists
    if len(src) == len(dst) and all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)  # clipping scales the gradients in place
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)  # x * 1.0 == x exactly: the copy upstream makes
    else:
        for a, b in zip(src, dst):
            b.copy_(a * scale)


@contextlib.contextmanager
def foreach_multi_tensor():
    """Inside the block mcore's local multi-tensor fallbacks (if it uses them) run as
    :func:`_foreach_l2_norm` / :func:`_foreach_scale`; restored on exit."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    swaps = [(owner, name, new) for owner, name, old, new in (
        (clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, _foreach_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, _foreach_scale),
        (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, _foreach_scale))
        if getattr(owner, name, None) is old]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    try:
        for owner, name, new in swaps:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)
