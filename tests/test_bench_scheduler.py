"""benchmarks/bench_scheduler.py runs end to end on a tiny case (its numbers are not
checked: timings are no test), and rejects bad cases with exit 2."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_scheduler
    finally:
        sys.path.pop(0)
    return bench_scheduler


@pytest.mark.skipif(__import__("skrull_ext")._backend.CPP is None, reason="needs skrull_ext._C")
@pytest.mark.parametrize("stat", ["median", "min"])
def test_tiny_case_writes_a_row(bench, tmp_path, capsys, stat):
    out = tmp_path / "rows.json"
    assert bench.main(["--cases", "64:4000", "--runs", "2", "--python-max-k", "64",
                       "--skip-megatron", "--stat", stat, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["K"] == 64 and row["micro_batches"] >= 1 and row["bound_ratio"] >= 1.0
    assert min(row["core_ms"], row["schedule_ms"], row["python_ms"]) > 0
    assert f"{stat} wall ms" in capsys.readouterr().out


def test_bad_cases_exit_2(bench, capsys):
    assert bench.main(["--cases", "64"]) == 2
    assert "error: --cases takes K:bucket pairs" in capsys.readouterr().err
