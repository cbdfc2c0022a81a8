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


@pytest.mark.skipif(__import__("skrull_ext")._backend.CPP is None, reason="needs skrull_ext._C")
def test_calibrate_prints_units_per_ms(bench, tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert bench.main(["--calibrate", "--cases", "1024:4000", "--runs", "30",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["budget"] for r in rows] == list(bench.CALIBRATE_BUDGETS)
    assert all(r["ms"] > 0 and r["work"] > 0 for r in rows)
    assert "units/ms" in capsys.readouterr().out


@pytest.mark.skipif(__import__("skrull_ext")._backend.CPP is None, reason="needs skrull_ext._C")
def test_refine_timing_counts_the_budget_deterministically(bench):
    """The search spends its budget (or converges before it: then a 10x budget spends the
    same), and the count, unlike the time, is the same on every call."""
    from skrull_ext import _backend
    from skrull_ext.costmodel.model import default_cost_model

    cm = default_cost_model()
    lengths = bench.long_tail_lengths(2048, 3, 8 * 3000 - 16)
    costs, comm, shares = cm.schedule_arrays(lengths, 8)

    def spent(budget):
        return _backend.CPP.refine_timing(lengths, costs, comm, cm.comm_latency(8), 4, 8, 3000,
                                          cm.micro_batch_overhead, shares, 1, budget)[0]

    assert spent(0) == 0
    for budget in (500, 20_000):
        work = spent(budget)
        assert work == spent(budget)
        assert work >= budget or work == spent(10 * budget)
