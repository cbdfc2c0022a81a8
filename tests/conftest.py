"""Test-session settings shared by every test module."""
from __future__ import annotations

import os
import shutil
import tempfile

_CREATED = []


def pytest_configure(config):
    """Benchmarks run by the tests record their results in a temporary directory, not in
    ``benchmarks/results/`` (``benchmarks/results_io.py``); subprocesses inherit it."""
    if "SKRULL_RESULTS_DIR" not in os.environ:
        _CREATED.append(tempfile.mkdtemp(prefix="skrull-test-results-"))
        os.environ["SKRULL_RESULTS_DIR"] = _CREATED[-1]


def pytest_unconfigure(config):
    for path in _CREATED:
        shutil.rmtree(path, ignore_errors=True)
