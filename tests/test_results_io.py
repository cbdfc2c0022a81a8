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
    import render_gpu
    import render_tables
    import render_training
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
    path = results_io.record("bench_x_cuda", [], run, ["--device", "cuda"], script="bench_x")
    assert os.path.basename(path).startswith("bench_x_cuda-2")
    assert json.loads(open(path).read())["meta"]["command"] == "benchmarks/bench_x.py --device cuda"
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
    text = "\n".join(render_gpu.gpu_check(page))
    assert "torch 2.11, CUDA 13.0" in text and "| cp_timing | not run | - | needs 2 GPUs |" in text
    assert ("torch bf16: out 1.0e-03, grad 2.0e-03, LSE 3.0e-03 (1/1 ok); x bf16: out 1.0e-03, "
            "grad NaN (0/2 ok; Boom: bad)") in text
    # A later run of some sections: its results replace those sections' only; a section it
    # did not run leaves the older result standing.
    _write(results, "gpu_check", "2026-01-02T0000Z", [], {
        "parity": {"status": "ok", "seconds": 1.0, "rows": parity[:1]},
        "cp_timing": {"status": "not run", "reason": "still 1 GPU"}},
        quiet=True, versions={"torch": "2.11", "cuda": "13.0"}, machine="H200", commit="b" * 40)
    lines = render_gpu.gpu_check(page)
    assert sum(line.startswith("| parity | ok | 1.0 | torch bf16: out 1.0e-03") and
               "01-02" in line and "bbbbbbb" in line for line in lines) == 1
    assert any(line.startswith("| cp_timing | not run | - | needs 2 GPUs |") for line in lines)
    row = lambda system, variant, tok, iters=4: {
        "system": system, "variant": variant, "tokens_per_s": tok, "tflops_per_gpu": 1.0,
        "mfu": 0.5, "iterations": iters}
    _write(results, "bench_gpu", "2026-01-01T0000Z", [], {"models": {
        "m": {"rows": [row("ours", "torch", 300.0), row("transformers", "sdpa", 100.0),
                       row("transformers", "eager", 50.0),
                       {"system": "ours", "variant": "te", "skipped": "not installed"}]},
        "n": {"rows": [row("ours", "torch", 10.0),
                       {"system": "ours", "variant": "te", "skipped": "not installed"}]}}},
        quiet=True)
    # A newer smoke run (2 timed iterations) goes to the history, not the table.
    _write(results, "bench_gpu", "2026-01-02T0000Z", [], {"models": {
        "m": {"rows": [row("ours", "torch", 200.0, 2), row("transformers", "sdpa", 100.0, 2)]}}},
        quiet=True)
    lines = render_gpu.gpu_throughput(page)
    assert lines[0].endswith(" Not run (not installed): ours te.")
    assert "2026-01-01T0000Z" in lines[0] and not any("**200**" in line for line in lines)
    assert "| m | ours | torch | **300** | 1.0 | 50.0% | 3.00x |" in lines
    assert "| m | transformers | eager | **50** | 1.0 | 50.0% | 0.50x |" in lines
    assert "| n | ours | torch | **10** | 1.0 | 50.0% | - |" in lines


def test_gpu_cost_model_memory_and_headline_tables(results):
    """The calibration's errors, the memory table per shape and setting (an out-of-memory
    shown as such, newer results per shape), README's GPU row; CPU runs are left out."""
    summary = lambda med, mx, tot, n: {"n": n, "median_abs_pct": med, "max_abs_pct": mx,
                                       "total_pct": tot}
    cal = {"calibration": {"device": "NVIDIA H200", "kernel": "torch",
                           "model": {"num_layers": 24, "hidden_size": 896}},
           "fit": {"error": summary(1.0, 4.0, -0.3, 7)},
           "validation": {"summary": summary(1.8, 2.6, -1.0, 8), "skipped_first": 2},
           "online": {"h100": {"summary": summary(2.4, 6.8, 2.8, 11), "skipped_first": 5}},
           "cost_model": {"c_linear": 2.5e-15, "c_attention": 4e-15,
                          "micro_batch_overhead": 0.09, "iteration_overhead": 0.034},
           "kernels": {"dense": {"tflops": 600.0}}}
    _write(results, "calibrate_gpu", "2026-01-01T0000Z", [], cal, quiet=True,
           command="benchmarks/calibrate_gpu.py --skrull-bucket-size 32768",
           machine="NVIDIA H200 (140 GiB), 16 CPU cores")
    cpu = dict(cal, calibration=dict(cal["calibration"], device="cpu (x86_64, 1 threads)"),
               validation={"summary": summary(50.0, 60.0, 1.0, 8), "skipped_first": 2})
    _write(results, "calibrate_gpu", "2026-01-02T0000Z", [], cpu, quiet=True, command="x")
    page = str(results.parent / "docs" / "gpu.md")
    text = "\n".join(render_gpu.gpu_cost_model(page))
    assert "| held-out: the launcher's loop, the written file, fixed | 8 (after 2) | **1.8%** | " \
           "2.6% | -1.0% | 15% |" in text and "bucket 32768" in text and "50.0%" not in text
    assert "dense layers and head 400 TFLOP/s in training (600 in the kernel runs alone)" in text
    row = lambda bucket, err, oom=False: {"bucket": bucket, "measured_peak": 2 * 2**30,
                                          "predicted_peak": 2**30, "error_pct": err, "oom": oom}
    setting = lambda name, rows, rec: {"setting": name, "rows": rows, "recommended": rec,
                                       "alpha_model": 10.0, "fit": {"alpha_bytes_per_token": 9.0}}
    env = {"environment": {"device": "NVIDIA H200"}}
    _write(results, "bench_memory_cuda", "2026-01-01T0000Z", [], dict(env, settings=[
        setting("selective", [row(8192, -9.0)], row(50000, 0.0, oom=True))]), quiet=True,
        command="benchmarks/bench_memory.py --device cuda")
    _write(results, "bench_memory_cuda", "2026-01-02T0000Z", [], dict(env, settings=[
        setting("selective", [row(8192, -0.3), row(16384, -0.2)], row(52665, -0.1))]),
        quiet=True, command="benchmarks/bench_memory.py --device cuda")
    _write(results, "bench_memory_cuda", "2026-01-03T0000Z", [], dict(env, settings=[
        setting("full", [row(8192, 0.4)], row(131669, 0.2, oom=True))]), quiet=True,
        command="benchmarks/bench_memory.py --device cuda --shape qwen2.5-1.5b")
    lines = render_gpu.gpu_memory(page)
    assert any(line.startswith("| 0.5B, selective | 2.00 / 1.00 (-0.3%) | 2.00 / 1.00 (-0.2%) "
                               "| 52,665: **2.00 / 1.00 (-0.1%)** | 9 / 10 |") for line in lines)
    assert any(line.startswith("| 1.5B, full | 2.00 / 1.00 (+0.4%) | - | "
                               "131,669: **out of memory (predicted 1.00)** |") for line in lines)
    assert not any("-9.0%" in line for line in lines)
    tput = lambda system, tok: {"system": system, "variant": "torch" if system == "ours"
                                else "sdpa", "tokens_per_s": tok, "iterations": 4}
    _write(results, "bench_gpu", "2026-01-01T0000Z", [], {"models": {
        "qwen2.5-0.5b": {"rows": [tput("ours", 320.0), tput("transformers", 100.0)]},
        "qwen2.5-1.5b": {"rows": [tput("ours", 340.0), tput("transformers", 100.0)]}}},
        quiet=True, machine="NVIDIA H200 (140 GiB), 16 CPU cores")
    head = render_gpu.headline_row(str(results.parent / "README.md"))
    assert head[0].startswith("one GPU (H200), Qwen2.5-0.5B / 1.5B shapes")
    assert head[1].startswith("**3.2x / 3.4x** transformers' tokens/s; iteration time "
                              "predicted within **1.8%** (median, held out), peak memory "
                              "within **0.4%**")
    # A newer calibration on another GPU: the row names it.
    _write(results, "calibrate_gpu", "2026-01-04T0000Z", [], dict(
        cal, validation={"summary": summary(4.1, 5.5, -2.5, 8), "skipped_first": 2}),
        quiet=True, command="x", machine="NVIDIA H100 80GB HBM3 (81559 MiB), 16 CPU cores")
    head = render_gpu.headline_row(str(results.parent / "README.md"))
    assert "within **4.1%** (median, held out, H100 80GB HBM3), peak" in head[1]


def test_launcher_tables_pick_their_configuration(results):
    """docs/costmodel.md's and docs/parallelism.md's tables: the end-to-end tables read only
    the default 256-wide run with a time split, the calibration has a column per model, the
    pipeline table is the newest run whatever the load."""
    pol = lambda name, med, total, split=None: {
        "policy": name, "median_iteration_ms": med, "total_s": total, "total_ratio": total / 10,
        "local_share": 0.5, "micro_batches": 1.0, "predicted_ms": med, "split_s": split or {
            "attn_local": 1.0, "attn_ring": 2.0, "ring_wait": 0.1, "ring_other": 0.2,
            "linear": 3.0, "model_other": 0.5, "data": 0.1, "grad_allreduce": 0.1,
            "optimizer": 0.2}}
    h256 = {"policies": [pol("skrull", 1000, 10), pol("all-cp", 1100, 11)],
            "iterations": [{"iter": 0, "longest": 900, "skrull": [100.0, 90.0],
                            "all-cp": [120.0, 95.0]}]}
    _write(results, "bench_e2e_cpu", "2026-01-01T0000Z", [0.5], h256,
           command="benchmarks/bench_e2e_cpu.py")
    _write(results, "bench_e2e_cpu", "2026-01-02T0000Z", [0.5], h256,
           command="benchmarks/bench_e2e_cpu.py --model h128 --iters 5")
    page = str(results.parent / "docs" / "costmodel.md")
    lines = render_training.e2e_cpu_h256(page)
    assert "bench_e2e_cpu-2026-01-01T0000Z.json" in lines[0]
    assert "| all-cp | 1,100 ms | 1.10x | 11.0 s | **1.10x** | 50.0% | 1.0 | 1,100 ms |" in lines
    assert "| skrull | 1.00 | 2.00 | 0.10 | 0.20 | 3.00 | 0.50 | 0.40 | 7.20 |" in \
        render_training.e2e_cpu_h256_split(page)
    assert "| iteration 0 | 900 | 100 | 120 |" in render_training.e2e_cpu_h256_batches(page)
    fit = lambda peak, mean: {"preset": {"peak_flops": peak, "attention_efficiency": 1.5,
                                         "attention_half_tokens": 500.0,
                                         "layer_overhead_s": 9e-3},
                              "ring_latency_s": 0.0, "runs": 50,
                              "fit_error": {"simulator": {"mean_abs_pct": mean}}}
    _write(results, "calibrate_training_cpu", "2026-01-01T0000Z", [], fit(80e9, 2.0),
           command="benchmarks/calibrate_training_cpu.py --model h128")
    _write(results, "calibrate_training_cpu", "2026-01-02T0000Z", [], fit(90e9, 3.0),
           command="benchmarks/calibrate_training_cpu.py")
    cal = render_training.cpu_calibration(page)
    assert cal[2].startswith("| constant | `--model h256` (the `cpu` preset) | `--model h128`")
    assert "| everything outside attention (matmuls, norms, RoPE, loss) | 90.0 GFLOP/s | " \
        "80.0 GFLOP/s |" in cal
    assert "| fit error, simulator: mean / max | 3.0% / - | 2.0% / - |" in cal
    pp = lambda bucket: [{"profile": "p", "pp": 1, "dp": 4, "bucket": bucket,
                          "skrull_plan_order": 2.0, "skrull_best": 2.0, "all-cp_best": 3.0,
                          "skrull_mbs": 1.0, "skrull_bubble": 0.0, "skrull_tuned": 2.0,
                          "tuned_bucket": bucket}]
    _write(results, "pp_table", "2026-01-01T0000Z", [0.1], pp(100), quiet=True)
    _write(results, "pp_table", "2026-01-02T0000Z", [9.0], pp(200))
    assert "| p | 1 | 4 | 200 | 2.00 | 2.00 | 3.00 | 1.50x | 1.0 | 0.0% | 2.00 (200) |" in \
        render_training.pp_table(page)


def test_no_committed_result_is_a_test_run():
    """Tests record into a temporary directory (tests/conftest.py); a result whose command
    names pytest's temporary paths was written by a test and must not be committed."""
    import glob

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "results")
    leftovers = [os.path.basename(p) for p in glob.glob(os.path.join(root, "*.json"))
                 if "pytest-of-" in json.load(open(p, encoding="utf-8")).get(
                     "meta", {}).get("command", "")]
    assert not leftovers, leftovers
