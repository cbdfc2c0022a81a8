"""What the two planning CLIs share: size guards, flag names in messages, a progress line.

``python -m skrull_ext.plan`` and ``skrull-plan`` take sizes straight from a user; an absurd
value must be one ``error:`` line naming the flag, never an ``OverflowError``, a pybind
``TypeError`` or a run that eats all memory (``--dp-size 100000000`` made the scheduler
allocate per-rank lists until it was killed at 21.5 GB).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Optional, TextIO

# Largest D x N either CLI plans: 2^20 ranks is ~10x the largest GPU clusters built.
MAX_RANKS = 1 << 20
# Most sequence lengths one CLI run schedules: ~10 M lengths take ~2 min and ~5 GB on a
# 2-core machine, so 2^24 (~16.8 M) bounds a run to a few minutes and ~9 GB.
MAX_SAMPLES = 1 << 24
# Longest sequence: the C++ core's bound (lengths in [1, 2^40]).
MAX_LENGTH = 1 << 40


class SizeError(ValueError):
    """A size outside what the CLI can plan; the message names the flag."""


def count(text: str) -> int:
    """argparse ``type`` for counts: ``64``, ``1e8`` (if integral) or ``1_000``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if not value.is_integer():  # inf and nan are not integers either
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def check_layout(dp_size: int, cp_size: int, *, dp_flag: str = "--dp-size",
                 cp_flag: str = "--cp-size") -> None:
    """Both >= 1 and D x N <= :data:`MAX_RANKS`.

    Raises:
        SizeError: naming the flag to change.
    """
    for flag, value in ((dp_flag, dp_size), (cp_flag, cp_size)):
        if value < 1:
            raise SizeError(f"{flag} must be >= 1, got {value}")
    if dp_size * cp_size > MAX_RANKS:
        raise SizeError(f"{dp_flag} {dp_size} x {cp_flag} {cp_size} = {dp_size * cp_size} "
                        f"ranks; this tool plans at most {MAX_RANKS} (plan one slice of the "
                        f"cluster: the schedule of each DP replica is independent)")


def check_bucket(bucket_size: int, flag: str = "--bucket-size") -> None:
    """1 <= bucket <= 2^40 (the core's bound; larger buckets mean nothing)."""
    if not 1 <= bucket_size <= MAX_LENGTH:
        raise SizeError(f"{flag} must be in [1, 2^40], got {bucket_size}")


def report_unexpected(prog: str, exc: BaseException) -> int:
    """A failure no check caught: one line (the traceback with ``SKRULL_DEBUG=1``), status 1."""
    if os.environ.get("SKRULL_DEBUG", "0") not in ("", "0"):
        raise exc
    print(f"{prog}: error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
          " (rerun with SKRULL_DEBUG=1 for the traceback)", file=sys.stderr)
    return 1


def check_sample_count(n: int, what: str) -> None:
    """At most :data:`MAX_SAMPLES` lengths in one run; ``what`` names the flags."""
    if n > MAX_SAMPLES:
        raise SizeError(f"{what} = {n} sequences to schedule; at most {MAX_SAMPLES} per run "
                        "(about 4 minutes and 9 GB here): plan a sample of the data")


def name_flags(message: str, *, bucket: str = "--bucket-size", cp: str = "--cp-size",
               dp: str = "--dp-size") -> str:
    """Rewrites the scheduler's generic flag names into the ones this CLI has.

    The scheduler library serves the launcher (``--skrull-bucket-size``,
    ``--context-parallel-size``) and the CLIs (``--bucket-size``, ``--cp-size``), so its
    messages name both; a user should read only the flag they typed.
    """
    for both, ours in ((
            "(--skrull-bucket-size / --bucket-size)", f"({bucket})"),
            ("--bucket-size / --skrull-bucket-size", bucket),
            ("--cp-size / --context-parallel-size", cp),
            ("--skrull-bucket-size", bucket),
            ("--context-parallel-size", cp),
            ("--dp-size", dp)):
        message = message.replace(both, ours)
    return message


class Progress:
    """Context manager: one stderr line once work has run for ``delay`` seconds, then the
    elapsed time (updated in place on a terminal) and a final line with the total.

    Quick runs print nothing, so scripted use stays clean.
    """

    def __init__(self, prog: str, label: str, *, delay: float = 1.0,
                 stream: Optional[TextIO] = None):
        self.prog, self.label, self.delay = prog, label, delay
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._shown = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = 0.0

    def _tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        self._shown = True
        tty = self._tty()
        self.stream.write(f"{self.prog}: {self.label} ...")
        self.stream.write("" if tty else "\n")
        self.stream.flush()
        while tty and not self._stop.wait(1.0):
            self.stream.write(f"\r{self.prog}: {self.label} ... "
                              f"{time.monotonic() - self._start:.0f} s")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._shown:
            prefix = "\r" if self._tty() else ""
            self.stream.write(f"{prefix}{self.prog}: {self.label}: done in "
                              f"{time.monotonic() - self._start:.1f} s\n")
            self.stream.flush()
