"""benchmarks/results_io.py records a run; benchmarks/render_tables.py picks and draws it."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
try:
    import render_tables
    import results_io
finally:
    sys.path.pop(0)


def test_record_writes_meta_and_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SKRULL_RESULTS_DIR", str(tmp_path))
    run = results_io.start()
    path = results_io.record("bench_x", [{"ms": np.float64(1.5), "n": np.int64(3)}], run,
                             ["--runs", "2"], stat="min")
    data = json.loads(open(path).read())
    meta = data["meta"]
    assert os.path.basename(path).startswith("bench_x-2") and path.endswith("Z.json")
    assert meta["command"] == "benchmarks/bench_x.py --runs 2" and meta["stat"] == "min"
    assert meta["cpus"] == os.cpu_count() and len(meta["load_average"]["end"]) == 3
    assert len(meta["commit"]) in (0, 40) and meta["seconds"] >= 0
    assert data["rows"] == [{"ms": 1.5, "n": 3}]
    assert "results recorded in" in capsys.readouterr().out
    monkeypatch.setenv("SKRULL_RESULTS_DIR", "")
    assert results_io.record("bench_x", [], run) is None


def _write(directory, name, date, load, rows, **meta):
    with open(os.path.join(directory, f"{name}-{date}.json"), "w") as f:
        json.dump({"meta": {"date_utc": date, "cpus": 2, "load_average": {"start": load},
                            **meta}, "rows": rows}, f)


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(results_io, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(render_tables, "ROOT", str(tmp_path.parent))
    monkeypatch.setattr(render_tables, "_tracked", lambda: None)
    return tmp_path


def test_current_is_the_newest_quiet_run(results):
    _write(results, "bench_y", "2026-01-01T0000Z", [0.5, 1, 1], [1])
    _write(results, "bench_y", "2026-01-02T0000Z", [0.9, 1, 1], [2])
    _write(results, "bench_y", "2026-01-03T0000Z", [7.0, 5, 5], [3])
    _write(results, "bench_y", "2026-01-04T0000Z", [], [4], quiet=False)
    assert [r["rows"] for r in render_tables.runs("bench_y")] == [[1], [2], [3], [4]]
    assert render_tables.current("bench_y")["rows"] == [2]
    assert render_tables.current("bench_y", lambda r: r["rows"] != [2])["rows"] == [1]
    assert render_tables.current("nothing") is None


def test_numbers_ranges_and_runs_format():
    assert render_tables.num(None) == "-"
    assert render_tables.num(0.123) == "0.12" and render_tables.num(1384) == "1,384"
    assert render_tables.num([0.10, 0.11]) == "0.10-0.11" and render_tables.num([1.0, 1.0]) == "1.0"
    assert render_tables.num({"runs": [55.3, 33.6]}) == "55.3 / 33.6"
    assert render_tables.pct([0.05, 0.061]) == "5.0%-6.1%"


def test_blocks_are_replaced_and_unknown_names_reported(tmp_path, monkeypatch):
    monkeypatch.setitem(render_tables.TABLES, "t", lambda page: ["| a |", "|---|", "| 1 |"])
    page = tmp_path / "p.md"
    page.write_text("x\n<!-- table:t -->\nold\n<!-- /table -->\n<!-- table:zz -->\n"
                    "<!-- /table -->\n")
    text, unknown = render_tables.render_page(str(page))
    assert "<!-- table:t -->\n| a |\n|---|\n| 1 |\n<!-- /table -->" in text
    assert "old" not in text and unknown == ["zz"]


def test_gpu_tables_from_a_check_and_a_throughput_run(results):
    """A failing kernel's NaN and error reach the section table; throughput rows are against
    the best transformers row of their model; what was not installed is listed once."""
    parity = [{"kernel": "torch", "dtype": "bf16", "out": 1e-3, "grad": 2e-3, "lse": 3e-3,
               "ok": True},
              {"kernel": "x", "dtype": "bf16", "out": 1e-3, "grad": "NaN", "lse": None,
               "ok": False},
              {"kernel": "x", "dtype": "bf16", "ok": False, "error": "Boom: bad"}]
    _write(results, "gpu_check", "2026-01-01T0000Z", [], {
        "parity": {"status": "FAIL", "seconds": 2.0, "rows": parity},
        "cp_timing": {"status": "not run", "reason": "needs 2 GPUs"}},
        quiet=True, versions={"torch": "2.11", "cuda": "13.0"}, machine="H200")
    page = str(results.parent / "docs" / "gpu.md")
    text = "\n".join(render_tables.gpu_check(page))
    assert "torch 2.11, CUDA 13.0" in text and "| cp_timing | not run | - | needs 2 GPUs |" in text
    assert ("torch bf16: out 1.0e-03, grad 2.0e-03, LSE 3.0e-03 (1/1 ok); x bf16: out 1.0e-03, "
            "grad NaN (0/2 ok; Boom: bad)") in text
    row = lambda system, variant, tok: {"system": system, "variant": variant, "tokens_per_s": tok,
                                        "tflops_per_gpu": 1.0, "mfu": 0.5}
    _write(results, "bench_gpu", "2026-01-01T0000Z", [], {"models": {
        "m": {"rows": [row("ours", "torch", 300.0), row("transformers", "sdpa", 100.0),
                       row("transformers", "eager", 50.0),
                       {"system": "ours", "variant": "te", "skipped": "not installed"}]},
        "n": {"rows": [row("ours", "torch", 10.0),
                       {"system": "ours", "variant": "te", "skipped": "not installed"}]}}},
        quiet=True)
    lines = render_tables.gpu_throughput(page)
    assert lines[0].endswith(" Not run (not installed): ours te.")
    assert "| m | ours | torch | **300** | 1.0 | 50.0% | 3.00x |" in lines
    assert "| m | transformers | eager | **50** | 1.0 | 50.0% | 0.50x |" in lines
    assert "| n | ours | torch | **10** | 1.0 | 50.0% | - |" in lines
