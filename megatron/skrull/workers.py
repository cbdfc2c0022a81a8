"""Ordered process-parallel map and a progress line (``tools/preprocess_sft.py --workers``).

:func:`ordered_map` runs ``func`` over chunks in worker processes and yields the results in
the order of the chunks, so what is written from them does not depend on the number of
workers (the output is byte-identical to one worker).  At most ``2 x workers`` chunks are in
flight: a large input is streamed, never read into memory ahead of the writer.  An exception
in a worker is raised in the caller at its chunk's turn (the same first error as one worker
would stop at); the pool is then terminated.

Processes rather than threads: tokenizing a chat is mostly Python (the chat template's
Jinja rendering, the loss-mask walk), which holds the GIL.
"""
from __future__ import annotations

import collections
import multiprocessing
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO


def _context():
    # fork starts a worker in milliseconds and shares the parent's imports; the parent has
    # not used the tokenizer's thread pool (nothing is encoded before the pool starts).
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def ordered_map(func: Callable[[Any], Any], chunks: Iterable[Any], *, workers: int,
                initializer: Optional[Callable] = None, initargs: tuple = ()) -> Iterator[Any]:
    """``func(chunk)`` for every chunk, in order, on ``workers`` processes.

    Args:
        func: A module-level (picklable) function.
        chunks: Work items, consumed lazily.
        workers: Processes; ``<= 1`` runs ``func`` in this process (no initializer call).
        initializer: Called once in every worker process with ``initargs``.

    Yields:
        ``func(chunk)`` in the order of ``chunks``.
    """
    if workers <= 1:
        for chunk in chunks:
            yield func(chunk)
        return
    pool = _context().Pool(workers, initializer=initializer, initargs=initargs)
    pending: collections.deque = collections.deque()
    try:
        for chunk in chunks:
            pending.append(pool.apply_async(func, (chunk,)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def chunked(items: Iterable[Any], size: int) -> Iterator[list]:
    """``items`` in lists of ``size`` (the last one shorter)."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Prints ``N records (P% of the input) | R records/s | ETA T`` every ``interval`` records.

    Args:
        fraction: Share of the input read so far (``[0, 1]``; the ETA extrapolates it).
        interval: Records between lines (``--log-interval``; 0: silent).
        prog: Line prefix.
        stream: Where lines go (default ``sys.stderr``).
    """

    def __init__(self, fraction: Callable[[], float], interval: int, *, prog: str,
                 stream: Optional[TextIO] = None) -> None:
        self.fraction, self.interval, self.prog = fraction, interval, prog
        self.stream = stream if stream is not None else sys.stderr
        self.records, self.lines = 0, 0
        self.start = time.perf_counter()

    def line(self) -> str:
        elapsed = max(1e-9, time.perf_counter() - self.start)
        done = min(1.0, max(0.0, self.fraction()))
        eta = _duration(elapsed * (1 - done) / done) if done > 0 else "?"
        return (f"{self.prog}: {self.records} records ({100 * done:.1f}% of the input) | "
                f"{self.records / elapsed:.0f} records/s | ETA {eta}")

    def update(self, records: int) -> None:
        """Counts ``records`` more; prints when a multiple of ``interval`` is passed."""
        before, self.records = self.records, self.records + records
        if self.interval > 0 and before // self.interval != self.records // self.interval:
            print(self.line(), file=self.stream, flush=True)
            self.lines += 1

    def finish(self) -> None:
        """A closing line with the total time, if any progress line was printed."""
        if self.lines:
            elapsed = time.perf_counter() - self.start
            print(f"{self.prog}: {self.records} records in {_duration(elapsed)} "
                  f"({self.records / max(elapsed, 1e-9):.0f} records/s)", file=self.stream,
                  flush=True)
