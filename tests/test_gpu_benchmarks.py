"""calibrate_gpu.py, bench_memory.py --device, bench_gpu.py and profile_step.py end to end on
CPU (tiny shape).

One spawned process runs the three scripts as the GPU script will (``--device cpu`` instead
of ``cuda``, small budgets); the tests then check what each wrote: JSON shapes, the cost-model
file loading as the launcher loads it, the held-out run's logged predictions, the planner's
bucket training, and the transformers baseline on the same batches.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

from mcore_helpers import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ["--device", "cpu", "--seq-length", "128", "--skrull-bucket-size", "128",
            "--global-batch-size", "4", "--mock-num-samples", "128"]


def _run_scripts(rank, world, tmp):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_gpu
    import bench_memory
    import calibrate_gpu
    import profile_step

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        calibrate_gpu.main(["--shape", "tiny", *TINY_RUN, "--time-budget-s", "300",
                            "--validate-iters", "3", "--online-iters", "6", "--repeats", "1",
                            "--json", f"{tmp}/cal.json", "--cost-model-config", f"{tmp}/cm.json"])
        bench_memory.main(["--device", "cpu", "--device-memory-gb", "0.005", "--buckets", "64",
                           "128", "--settings", "selective,full", "--time-budget-s", "300",
                           "--json", f"{tmp}/mem.json"])
        bench_gpu.main(["--models", "tiny", *TINY_RUN, "--iters", "1", "--kernels", "torch,flash",
                        "--time-budget-s", "300", "--json", f"{tmp}/gpu.json"])
        profile_step.main(["--shape", "tiny", *TINY_RUN, "--docs", "3", "--steps", "1",
                           "--timed-steps", "2", "--json", f"{tmp}/profile.json"])
    with open(f"{tmp}/stdout.txt", "w") as f:
        f.write(log.getvalue())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_scripts")
    spawn(_run_scripts, 1, tmp, timeout=600)
    load = lambda name: json.loads((tmp / name).read_text())  # noqa: E731
    return {"cal": load("cal.json"), "cm_path": str(tmp / "cm.json"), "mem": load("mem.json"),
            "gpu": load("gpu.json"), "profile": load("profile.json"),
            "stdout": (tmp / "stdout.txt").read_text()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibration_writes_a_launcher_cost_model_and_checks_it_on_a_held_out_run(outputs):
    from megatron.skrull.batch_schedule import build_cost_model

    from mcore_helpers import tiny_config

    cal = outputs["cal"]
    assert cal["calibration"]["torch"] and cal["calibration"]["date"]
    assert cal["kernels"]["kernel"] == "torch"
    assert {r["cp"] for r in cal["kernels"]["attention"]["rows"]} >= {1, 2}
    assert len(cal["fit"]["cases"]) == 7 and all(c["measured"] > 0 for c in cal["fit"]["cases"])
    tm = cal["fit"]["time_model"]
    assert all(tm[k] >= 0 for k in tm) and sum(tm[k] for k in tm) > 0
    # The file is what --skrull-cost-model-config reads (its metadata is accepted).
    cfg = tiny_config(["--skrull-cost-model-config", outputs["cm_path"]])
    cost = build_cost_model(cfg, vocab_size=256)
    assert cost.time.c_linear == pytest.approx(tm["c_linear"])
    assert cost.time.iteration_overhead == pytest.approx(tm["iteration_overhead"])
    rows = cal["validation"]["iterations"]
    assert len(rows) == 3 and all(r["predicted"] > 0 and r["measured"] > 0 for r in rows)
    assert cal["validation"]["summary"]["n"] == 1  # the first two are warm-up
    assert len(cal["online"]["h100"]["iterations"]) == 6
    assert "predicted (ms):" in outputs["stdout"]
    assert "throughput per GPU (TFLOP/s/GPU):" in outputs["stdout"]
    assert cal["budget"]["used"] < 300 and not cal["budget"]["skipped"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_memory_bench_compares_peaks_and_trains_the_planners_bucket(outputs):
    settings = outputs["mem"]["settings"]
    assert [s["setting"] for s in settings] == ["selective recompute", "full recompute"]
    for s in settings:
        assert [r["bucket"] for r in s["rows"]] == [64, 128]
        for r in s["rows"]:
            assert not r["oom"] and r["measured_peak"] > r["measured_static"] > 0
            assert r["predicted_peak"] > r["predicted_static"] > 0
            # CPU: static tensors plus saved tensors, the model's saved terms (composite norm)
            assert abs(r["error_pct"]) < 1, r
        assert s["fit"]["alpha_bytes_per_token"] > 0
        rec = s["recommended"]
        assert rec["bucket"] > 128 and not rec["oom"]
    sel, full = settings
    assert full["alpha_model"] < sel["alpha_model"]
    assert full["rows"][1]["measured_peak"] < sel["rows"][1]["measured_peak"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_throughput_bench_runs_ours_and_transformers_on_the_same_batches(outputs):
    tiny = outputs["gpu"]["models"]["tiny"]
    rows = {(r["system"], r["variant"]): r for r in tiny["rows"]}
    assert "flash-attn" in rows[("ours", "flash")]["skipped"]
    ran = [rows[k] for k in (("ours", "torch"), ("transformers", "sdpa packed"),
                             ("transformers", "sdpa per-doc"))]
    for r in ran:
        assert r["iterations"] == 1 and r["tokens_per_s"] > 0 and r["mfu"] is None
        # The same FLOPs for every system: TFLOP/s are proportional to tokens/s.
        assert r["tflops_per_gpu"] / r["tokens_per_s"] == pytest.approx(
            ran[0]["tflops_per_gpu"] / ran[0]["tokens_per_s"], rel=1e-9)
    assert "skipped" in rows[("transformers", "flash_attention_2")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_profile_step_names_the_ops_of_one_step(outputs):
    prof = outputs["profile"]
    assert prof["docs"] == 3 and prof["micro_batches"] >= 1
    assert prof["wall_ms_per_step_profiled"] > 0 and prof["device_busy_ms_per_step"] == 0.0
    assert prof["wall_ms_per_step_unprofiled"] > 0
    names = {r["name"] for r in prof["by_self_cpu"]}
    assert "aten::mm" in names or "aten::addmm" in names  # the linear layers ran
    assert "profile_step:" in outputs["stdout"]
