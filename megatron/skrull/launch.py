"""``python -m megatron.skrull.launch``: torchrun that reports like a single process.

Takes torchrun's flags unchanged, e.g.::

    python -m megatron.skrull.launch --standalone --nproc-per-node 2 \\
        -m megatron.skrull.pretrain_gpt --mock-data ...

Why a wrapper: stock ``torchrun`` turns any non-zero exit of a worker into an uncaught
``ChildFailedError`` (a traceback plus a ~25-line failure table, ~35 lines in all) and exits
1, whatever the worker's status.  Our workers already report their own problem on one line
(:mod:`megatron.skrull.errors`), so this wrapper runs the same elastic agent
(``torch.distributed.run.run``), keeps the agent's own log lines to errors only, and on a
failure exits with the failing rank's status (2 for bad input, 1 otherwise).  A rank killed
by a signal (out of memory, ``kill -9``) cannot report itself: the wrapper prints one
``error:`` line naming it.  ``--debug`` / ``SKRULL_DEBUG=1`` keeps torchrun's report.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

from megatron.skrull import errors


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def exit_status(failures: dict) -> tuple[int, Optional[str]]:
    """The launcher's status and its own message (None: the rank reported itself).

    Args:
        failures: ``{global rank: ProcessFailure}`` of the agent's run result.
    """
    killed = {r: f for r, f in failures.items() if f.exitcode < 0}
    # A rank that died from a signal nobody sent it on purpose is the root cause; the agent
    # SIGTERMs the survivors afterwards, so prefer SIGKILL/SIGSEGV/... over SIGTERM.
    for rank, failure in sorted(killed.items()):
        if -failure.exitcode != signal.SIGTERM:
            return errors.EXIT_FAILURE, (
                f"rank {rank} (pid {failure.pid}) was killed by {_signal_name(failure.exitcode)} "
                "(out of memory or killed); the other ranks were stopped. Resume from the "
                "last checkpoint with --load")
    reported = [f.exitcode for _, f in sorted(failures.items()) if f.exitcode > 0]
    if reported:
        return (reported[0] if reported[0] in (errors.EXIT_FAILURE, errors.EXIT_BAD_INPUT)
                else errors.EXIT_FAILURE), None
    rank = min(failures)
    return errors.EXIT_FAILURE, (
        f"rank {rank} was stopped by {_signal_name(failures[rank].exitcode)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs torchrun's agent; returns the first failing rank's status."""
    argv, debug = errors.take_debug_flag(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if debug:  # the ranks inherit it: their tracebacks too
        os.environ["SKRULL_DEBUG"] = "1"
        run(parse_args(argv))
        return 0
    # The agent logs every worker exit at ERROR and the table at ERROR too: the ranks
    # report their own problems, so only the agent's critical lines stay.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        code, message = exit_status(exc.failures)
        if message:
            print(f"error: {message}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
