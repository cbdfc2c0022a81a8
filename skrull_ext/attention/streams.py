"""CUDA streams of the DACP attention, behind one replaceable provider.

The local part of a micro-batch runs on a *side stream* while the ring (ours, or
Transformer Engine's) exchanges K/V; Transformer Engine also wants a second compute
stream of its own (``cp_stream``).  Both are created here, once per device, and every
stream operation the attention does goes through :func:`api`, so a test can install a
recording fake (``tests/fakes/streams.py``) and check the order of operations on CPU.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

#: ``SKRULL_ATTENTION_SIDE_STREAM=0`` runs the local part on the current stream (no
#: overlap on the GPU); for measuring what the side stream buys (tools/check_gpu.py).
SIDE_STREAM_ENV = "SKRULL_ATTENTION_SIDE_STREAM"

class CudaStreams:
    """The stream operations the attention uses, on ``torch.cuda``."""

    def new_stream(self, device: torch.device):
        return torch.cuda.Stream(device=device)

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def use(self, stream):
        """Context manager making ``stream`` current."""
        return torch.cuda.stream(stream)

    def record(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


_CUDA = CudaStreams()
#: ``device -> stream API or None`` (None: no streams, plain calls on CPU).  Tests replace
#: it with a recording fake of :class:`CudaStreams`.
_PROVIDER: Callable[[torch.device], Any] = lambda device: _CUDA if device.type == "cuda" else None
_STREAMS: dict = {}


def api(device: torch.device):
    """Stream API for ``device`` (:class:`CudaStreams` on CUDA, None on CPU)."""
    return _PROVIDER(device)


def named_stream(device: torch.device, name: str):
    """A process-wide stream ``name`` of ``device`` (created once); None without streams.

    ``"side"`` runs the DACP local part; ``"te_cp"`` is Transformer Engine's
    ``cp_stream``.  They are distinct streams, as TE's ring alternates its own compute
    between the current stream and ``cp_stream``.
    """
    cuda = api(device)
    if cuda is None:
        return None
    key = (id(cuda), str(device), name)
    if key not in _STREAMS:
        _STREAMS[key] = (cuda, cuda.new_stream(device))  # the API object is kept alive
    return _STREAMS[key][1]


class Overlap:
    """Runs work on the side stream and joins it back into the current stream.

    On CPU (no stream API) :meth:`run` is a plain call and :meth:`join` does nothing: the
    overlap there comes from gloo transferring in the background.
    """

    def __init__(self, device: torch.device):
        self.cuda = api(device) if os.environ.get(SIDE_STREAM_ENV, "1") != "0" else None
        self.side = named_stream(device, "side") if self.cuda is not None else None
        self.main = self.cuda.current(device) if self.cuda is not None else None

    def run(self, fn: Callable[[], Any]) -> Any:
        """Calls ``fn`` on the side stream, after the work already queued on the main one."""
        if self.cuda is None:
            return fn()
        self.side.wait_stream(self.main)  # its inputs were produced on the main stream
        with self.cuda.use(self.side):
            return fn()

    def join(self, *tensors: Optional[torch.Tensor]) -> None:
        """Makes the main stream wait for the side stream before ``tensors`` are used.

        The tensors were allocated on the side stream and will be read and freed on the
        main one: ``record_stream`` keeps the caching allocator from reusing their memory
        before the main stream is done with them.
        """
        if self.cuda is None:
            return
        self.main.wait_stream(self.side)
        for t in tensors:
            if t is not None:
                self.cuda.record(t, self.main)
