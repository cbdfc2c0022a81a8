"""Test-session settings shared by every test module."""
from __future__ import annotations

import os
import tempfile


def pytest_configure(config):
    """Benchmarks run by the tests record their results in a temporary directory, not in
    ``benchmarks/results/`` (``benchmarks/results_io.py``); subprocesses inherit it."""
    os.environ.setdefault("SKRULL_RESULTS_DIR",
                          tempfile.mkdtemp(prefix="skrull-test-results-"))
