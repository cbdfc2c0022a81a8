"""Recording fake of :class:`skrull_ext.attention.streams.CudaStreams` (CUDA streams on CPU).

Work is not deferred (CPU runs it at once); what the fake keeps is the ORDER of the
stream operations, in the same log as the communicator's posts and the kernels' calls:
``("wait_stream", waiter, waited)``, ``("enter", stream)`` / ``("exit", stream)``,
``("record_stream", stream)``.
"""
from __future__ import annotations

import contextlib


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self._log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self._log.append(("wait_stream", self.name, other.name))

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeStreams:
    """``new_stream`` / ``current`` / ``use`` / ``record`` like ``CudaStreams``."""

    def __init__(self, log: list):
        self.log = log
        self.main = FakeStream("main", log)
        self._current = self.main
        self.created: list[FakeStream] = []

    def new_stream(self, device) -> FakeStream:
        s = FakeStream(f"stream{len(self.created) + 1}", self.log)
        self.created.append(s)
        return s

    def current(self, device) -> FakeStream:
        return self._current

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        prev, self._current = self._current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self._current = prev
            self.log.append(("exit", stream.name))

    def record(self, tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name))
