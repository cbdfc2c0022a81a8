"""The attention kernel choice: ``--skrull-attention-kernel``, ``SKRULL_ATTENTION_KERNEL``
and ``dacp_attention(backend=)`` take the same names (:data:`KERNEL_CHOICES`).

``auto`` never picks a float64 kernel on CUDA: it takes Transformer Engine, else
flash-attn, else PyTorch's own FlashAttention-2 varlen op (``torch``, nothing to install),
else fails with what to install; the choice is logged once per device type.  ``torch``
names ATen's CPU flash attention on CPU and the FlashAttention-2 op on CUDA
(:mod:`skrull_ext.attention.aten`).
"""
from __future__ import annotations

import importlib
import logging
import os

import torch

import skrull_ext.attention.aten as aten
from skrull_ext.attention.flash import FlashAttnKernel
from skrull_ext.attention.kernels import CpuFlashKernel, ReferenceKernel
from skrull_ext.attention.te import TEBackend

log = logging.getLogger("skrull_ext.attention")

#: Values of ``--skrull-attention-kernel`` and ``SKRULL_ATTENTION_KERNEL``.
KERNEL_CHOICES = ("auto", "flash", "te", "torch", "reference")
ENV_VAR = "SKRULL_ATTENTION_KERNEL"
_ALIASES = {"cpu_flash": "torch", "flash_attn": "flash"}  # earlier names of ``backend=``


def _torch_kernel(device: torch.device):
    if device.type == "cpu":
        return CpuFlashKernel()
    _require(aten.flash_op_problem(device), "torch")
    return aten.TorchVarlenKernel()


def _require(problem, name: str) -> None:
    if problem is not None:
        raise RuntimeError(f"the {name} kernel cannot run here: {problem}; use "
                           "--skrull-attention-kernel auto (or te, flash)")


_BUILDERS = {"reference": lambda device: ReferenceKernel(), "torch": _torch_kernel,
             "flash": lambda device: FlashAttnKernel(), "te": lambda device: TEBackend()}


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False
    return True


def flash_attn_available() -> bool:
    """True when the optional ``flash_attn`` package imports."""
    return _importable("flash_attn")


def te_available() -> bool:
    """True when the optional ``transformer_engine.pytorch`` imports."""
    return _importable("transformer_engine.pytorch")


def kernel_name(name=None) -> str:
    """Canonical kernel name: ``name``, else ``$SKRULL_ATTENTION_KERNEL``, else ``auto``.

    Raises:
        ValueError: Unknown name (the message lists the choices).
    """
    source = "backend"
    if name is None:
        name, source = os.environ.get(ENV_VAR) or "auto", ENV_VAR
    name = _ALIASES.get(name, name)
    if name not in KERNEL_CHOICES:
        raise ValueError(f"unknown attention kernel {name!r} ({source}); use one of "
                         f"{', '.join(KERNEL_CHOICES)}")
    return name


_LOGGED: set = set()


def _auto(device: torch.device) -> str:
    if device.type == "cpu":
        return "torch"
    problem = aten.flash_op_problem(device)
    for name, ok in (("te", te_available), ("flash", flash_attn_available),
                     ("torch", lambda: problem is None)):
        if ok():
            if (device.type, name) not in _LOGGED:
                _LOGGED.add((device.type, name))
                log.info("attention kernel auto -> %s on %s", name, device.type)
            return name
    raise RuntimeError(
        f"no attention kernel for {device.type}: {problem}; install Transformer Engine or "
        "flash-attn (pip install 'skrull-megatron[gpu]', see the README's version table), or "
        "ask for the float64 reference kernel explicitly (--skrull-attention-kernel "
        "reference; slow)")


def runs_subgroups(backend, device: torch.device) -> bool:
    """Whether the attention ``backend`` resolves to can run CP sub-group placements.

    Every kernel can but ``te`` without a block kernel beside it (Transformer Engine's
    ring spans the whole CP group; the sub-group rings borrow flash-attn's kernel, else
    PyTorch's FlashAttention-2 op, docs/attention.md).
    The launcher turns the scheduler's hybrid-CP candidate off when this is False, so a
    TE-only install never gets a plan it cannot run.
    """
    name = kernel_name(backend)
    if name == "auto":
        if device.type == "cpu":
            return True
        name = "te" if te_available() else "flash"
    return name != "te" or flash_attn_available() or aten.flash_op_problem(device) is None


_CACHE: dict = {}


def get_kernel(backend, device: torch.device, dtype: torch.dtype):
    """Resolves a kernel name (or instance) for tensors on ``device``.

    Args:
        backend: One of :data:`KERNEL_CHOICES` (or an alias), None for
            ``$SKRULL_ATTENTION_KERNEL`` / ``auto``, or a kernel instance (returned as is).
        device: Device of the attention's tensors.
        dtype: Their dtype (kernels do not check it; the libraries do).

    Returns:
        An :class:`AttentionKernel`, or a :class:`~skrull_ext.attention.te.TEBackend`.

    Raises:
        ValueError: Unknown name.
        RuntimeError: The kernel's library is missing (or too old), or its op cannot run
            on ``device``; ``auto`` on CUDA with neither Transformer Engine, flash-attn nor
            a usable FlashAttention-2 op in torch.
    """
    del dtype  # the libraries check it
    if not isinstance(backend, (str, type(None))):
        return backend
    name = kernel_name(backend)
    if name == "auto":
        name = _auto(device)
    key = (name, device.type)  # ``torch`` is a different kernel on CPU and on CUDA
    if key not in _CACHE:
        _CACHE[key] = _BUILDERS[name](device)
    return _CACHE[key]
