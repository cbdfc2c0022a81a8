"""A micro-batch's host-known tensors on the device in ONE non-blocking copy.

Everything the device needs about a micro-batch besides the weights is known on the host
before it runs: the packed token ids, labels, loss mask and positions, and the attention
metadata of its layout (``cu_seqlens``, the zigzag index tensors, padding rows).  Moved one
by one with ``tensor.to("cuda")`` each is a pageable host-to-device copy, which PyTorch
completes with a ``cudaStreamSynchronize``: the host waits for the device to drain its queue,
so the next micro-batch's kernels cannot be queued behind the running ones (measured on one
H200, docs/gpu.md "Host work per step").

:func:`stage` moves all of them with one copy: the tensors are laid out back to back (each
aligned to :data:`ALIGN` bytes) in one pinned host buffer, copied with ``non_blocking=True``,
and handed out as typed views of the one device buffer (no device kernel per tensor).
PyTorch's caching host allocator keeps the pinned buffer alive until the copy has run.
On CPU the same packing runs (so the tests drive it) without pinning.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")
Move = Callable[[torch.Tensor], torch.Tensor]
#: Byte alignment of every tensor in the staging buffer (>= the widest dtype, and a cache
#: line, so kernels see aligned ``cu_seqlens`` and index tensors).
ALIGN = 64


def device_key(device) -> str:
    """One name per device (``cuda`` and ``cuda:0`` are the same device when 0 is current),
    for caches keyed by device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def to_device(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Host ``tensors`` on ``device`` in one copy (pinned and non-blocking on CUDA).

    Args:
        tensors: CPU tensors of any dtype and shape (empty ones included).
        device: Target device.

    Returns:
        The tensors in order, as views of one device buffer (contiguous, same dtype/shape).
    """
    device = torch.device(device)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    pin = device.type == "cuda"
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for t, at in zip(tensors, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[at:at + raw.numel()].copy_(raw)
    dev = buf.to(device, non_blocking=pin)
    return [dev[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, at in zip(tensors, offsets)]


def stage(build: Callable[[Move], T], device) -> T:
    """``build(move)`` with every tensor it passes to ``move`` on ``device``, in one copy.

    ``build`` makes device structures from host data, calling ``move(host_tensor)`` where it
    would call ``host_tensor.to(device)``.  It runs twice: once collecting the host tensors
    (``move`` returns its argument; the result is dropped), then with ``move`` returning
    their device copies (:func:`to_device`) in the same order, so it must move the same
    tensors in the same order both times (a function of host data only).

    Returns:
        The second run's result.
    """
    host: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        host.append(t)
        return t

    build(collect)
    moved = iter(to_device(host, device))
    out = build(lambda t: next(moved))
    if next(moved, None) is not None:
        raise RuntimeError("stage(): build moved fewer tensors the second time")
    return out
