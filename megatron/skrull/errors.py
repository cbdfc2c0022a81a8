"""How every user entry point reports a problem.

The contract (tested by ``tests/test_bad_input.py``):

* bad input (flags, data, tokenizer, checkpoint): one ``error:`` line per problem naming
  the fix, exit status 2 (:data:`EXIT_BAD_INPUT`);
* any other failure: one ``error:`` line with the exception, exit status 1
  (:data:`EXIT_FAILURE`); the Python traceback only with ``--debug`` or ``SKRULL_DEBUG=1``;
* under ``torchrun`` only rank 0 reports a problem every rank finds alike (flags, data);
  the other ranks exit with the same status and print nothing;
* dependency notices that are expected here (Megatron-Core without Transformer Engine or
  Apex on CPU) are filtered by message and module, so our own warnings still show.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import traceback
import warnings
from typing import Callable, Optional, Sequence, TypeVar

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
DEBUG_HINT = "rerun with --debug or SKRULL_DEBUG=1 for the traceback"

# Expected on a machine without Transformer Engine / Apex (every CPU run): Megatron-Core
# warns once per module at import, ~28 lines that say nothing actionable here.
DEPENDENCY_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)
_DEPENDENCY_MODULES = r"(megatron\.core|megatron_fsdp)"

# A collective whose peer process died: the peer (or the launcher) reports the cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")

T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid flags; ``problems`` holds one message (naming the fix) per problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# Megatron-Core 0.16's torch dist-checkpoint strategy still loads through torch's deprecated
# ``load_state_dict`` and ShardedTensor: FutureWarnings about mcore's code, two per rank on
# every load, that nothing a user of this stack does can change.
CHECKPOINT_DEPRECATIONS = (
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)


@contextlib.contextmanager
def quiet_checkpoint_deprecations():
    """Ignores :data:`CHECKPOINT_DEPRECATIONS` inside the block (a ``dist_checkpointing``
    load); every other warning, and these outside the block, still show."""
    with warnings.catch_warnings():
        for message in CHECKPOINT_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield


def filter_dependency_warnings() -> None:
    """Ignores :data:`DEPENDENCY_WARNINGS`, only when Megatron-Core's modules raise them."""
    for message in DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=_DEPENDENCY_MODULES)


def take_debug_flag(argv: Optional[Sequence[str]]) -> tuple[list[str], bool]:
    """Removes ``--debug`` from ``argv`` (default ``sys.argv[1:]``).

    Returns:
        ``(argv without --debug, debug)``; ``debug`` is also on with ``SKRULL_DEBUG=1``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("SKRULL_DEBUG", "0") not in ("", "0")
    return [a for a in args if a != "--debug"], debug


def env_rank() -> int:
    """This process's global rank under torchrun (0 without it)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report(lines: Sequence[str], *, prog: str = "", rank: Optional[int] = None,
           code: int = EXIT_BAD_INPUT) -> int:
    """Prints ``[prog: ]error: line`` for each line on rank 0 only; returns ``code``."""
    if (env_rank() if rank is None else rank) == 0:
        prefix = f"{prog}: " if prog else ""
        for line in lines:
            print(f"{prefix}error: {line}", file=sys.stderr, flush=True)
    return code


def report_failure(exc: BaseException, *, prog: str = "", debug: bool = False) -> int:
    """An unexpected failure on this rank: one line (or the traceback), status 1.

    Every rank that fails reports (the failure may be its own, e.g. a full disk), prefixed
    with its rank under torchrun.
    """
    if debug:
        traceback.print_exception(exc)
        return EXIT_FAILURE
    where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
    prefix = f"{prog}: " if prog else ""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if any(p in text for p in _PEER_LOST):  # gloo's long message hides the real cause
        text = ("lost the connection to another rank: that rank failed or was killed (see "
                "its error line)")
    print(f"{prefix}error: {where}{type(exc).__name__}: {text} ({DEBUG_HINT})",
          file=sys.stderr, flush=True)
    return EXIT_FAILURE


def parse_quietly(parse: Callable[[list[str]], T], argv: list[str], *, prog: str = "") -> T:
    """Runs an argparse-based ``parse(argv)`` with a one-line error on rank 0 only.

    argparse prints the whole usage (dozens of lines for the launcher) before its error;
    this keeps only the error line, adds where to look, and silences ranks other than 0.
    ``--help`` (exit 0) prints as usual.

    Raises:
        SystemExit: argparse's own exit (status 2 on a bad flag, 0 after ``--help``).
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            lines = [ln for ln in captured.getvalue().splitlines() if "error:" in ln]
            message = lines[-1].split("error:", 1)[1].strip() if lines else "bad arguments"
            report([f"{message} (see --help)"], prog=prog)
        raise


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one ``prog: error: ... (see --help)`` line, status 2."""

    def error(self, message):  # argparse's default prints the whole usage first
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")
