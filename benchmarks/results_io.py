"""Benchmark results as data: every run writes one dated JSON under ``benchmarks/results/``.

A benchmark calls :func:`start` when it begins and :func:`record` with its numbers when it
ends::

    run = results_io.start()
    ...
    results_io.record("bench_scheduler", rows, run, argv)

which writes ``benchmarks/results/bench_scheduler-2026-11-26T031205Z.json``::

    {"meta": {"date_utc", "command", "machine", "cpus", "load_average": {"start", "end"},
              "seconds", "commit", "dirty", "versions"},
     "rows": ...}                       # what the benchmark measured, its own shape

``benchmarks/render_tables.py`` turns the newest file of each benchmark into the tables the
docs show and lists the older ones as the history.  ``SKRULL_RESULTS_DIR`` redirects the
files (the tests point it at a temporary directory); set to an empty string it turns
recording off.  Only the standard library is used: recording must never fail a benchmark
that has already measured, so a missing ``git`` or an unwritable directory is one warning
line on stderr.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
ENV = "SKRULL_RESULTS_DIR"
VERSIONED = ("torch", "megatron-core", "numpy")


def results_dir() -> Optional[str]:
    """Where results go: ``$SKRULL_RESULTS_DIR`` if set (empty: nowhere), else the repo's."""
    value = os.environ.get(ENV)
    if value is None:
        return RESULTS_DIR
    return value or None


def start() -> dict:
    """The start of a run: wall clock and the 1/5/15-minute load averages."""
    return {"time": time.time(), "load": _load()}


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return []


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else the platform's word)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def meta(name: str, run: Optional[dict] = None,
         argv: Optional[Sequence[str]] = None, script: Optional[str] = None) -> dict:
    """Where and how the numbers were taken: date, command (``benchmarks/<script or
    name>.py`` and ``argv``), machine, load, commit."""
    now = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    out = {
        "date_utc": datetime.datetime.fromtimestamp(
            now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join([f"benchmarks/{script or name}.py", *argv]),
        "machine": f"{platform.machine()} {_cpu_model()}",
        "cpus": os.cpu_count(),
        "load_average": {"start": (run or {}).get("load", []), "end": _load()},
        # $SKRULL_COMMIT: the commit of a copied checkout whose .git is stale (a GPU kit).
        "commit": os.environ.get("SKRULL_COMMIT") or _git("rev-parse", "HEAD"),
        "dirty": (None if os.environ.get("SKRULL_COMMIT") else
                  bool(_git("status", "--porcelain", "--untracked-files=no"))),
        "versions": _versions(),
    }
    if run:
        out["seconds"] = round(now - run["time"], 1)
    return out


def record(name: str, rows: Any, run: Optional[dict] = None,
           argv: Optional[Sequence[str]] = None, *, script: Optional[str] = None,
           **extra: Any) -> Optional[str]:
    """Writes ``{"meta": ..., "rows": rows}`` (plus ``extra`` keys in meta) to
    ``<results dir>/<name>-<UTC date and time>.json``; returns the path, or None when
    recording is off or failed (one warning line).  ``script``: the benchmark's file name
    when it is not ``name`` (``bench_memory.py`` records ``bench_memory_cuda``)."""
    directory = results_dir()
    if directory is None:
        return None
    info = meta(name, run, argv, script)
    info.update(extra)
    stamp = info["date_utc"].replace(":", "")  # 2026-11-26T031205Z
    path = os.path.join(directory, f"{name}-{stamp}.json")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"meta": info, "rows": rows}, f, indent=1, default=_plain)
            f.write("\n")
    except (OSError, TypeError, ValueError) as exc:
        print(f"warning: results not recorded ({exc})", file=sys.stderr)
        return None
    print(f"results recorded in {os.path.relpath(path)}")
    return path


def _plain(value: Any) -> Any:
    """numpy scalars and arrays, tuples in keys' values, anything else as text."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    return str(value)


def load(path: str) -> dict:
    """One results file; a file without ``meta`` (an older format) gets an empty one."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "meta" not in data:
        data = {"meta": {}, "rows": data}
    return data


__all__ = ["start", "record", "meta", "load", "results_dir", "RESULTS_DIR"]
