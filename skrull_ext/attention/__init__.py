"""DACP attention (Skrull spec section 5): local sequences per document, distributed
sequences by zigzag ring attention over the CP group, overlapped.

Public API:
    dacp_attention(q, k, v, layout, cp_group, ...) -> out   (autograd-aware)
    RingComm(cp_group)                                     (replaceable communicator)
    get_kernel(name, device, dtype), AttentionKernel        (kernel back-ends)
    KERNEL_CHOICES, kernel_name(name)                       (auto, flash, te, torch, reference)
"""
from skrull_ext.attention.choice import (
    ENV_VAR,
    KERNEL_CHOICES,
    flash_attn_available,
    get_kernel,
    kernel_name,
    te_available,
)
from skrull_ext.attention.comm import RingComm
from skrull_ext.attention.function import dacp_attention
from skrull_ext.attention.kernels import AttentionKernel, CpuFlashKernel, ReferenceKernel, Segments

__all__ = [
    "AttentionKernel",
    "CpuFlashKernel",
    "ENV_VAR",
    "KERNEL_CHOICES",
    "ReferenceKernel",
    "RingComm",
    "Segments",
    "dacp_attention",
    "flash_attn_available",
    "get_kernel",
    "kernel_name",
    "te_available",
]
