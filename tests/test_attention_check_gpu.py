"""tools/check_gpu.py and its section modules on CPU: the dry run, its errors, the parity and
timing code driven through the fakes (flash-attn, Transformer Engine, PyTorch's ATen ops),
the orchestration (timeouts, budget, report), and the CP=2 worker's parity and stream-order
checks in one gloo world of 2 with the host-staged ring."""
import functools
import io
import json
import math
import os
import sys
import time

import pytest
import torch

import fakes
from fakes import aten as fake_aten
from fakes.streams import FakeStreams
from skrull_ext.attention import aten, choice

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import check_gpu  # noqa: E402
import gpu_check_cp  # noqa: E402
import gpu_check_kernels as gk  # noqa: E402

from _spawn import spawn_and_collect  # noqa: E402

CPU = torch.device("cpu")


def test_dry_run_plans_every_section(tmp_path):
    out = io.StringIO()
    assert check_gpu.main(["--dry-run", "--all", "--json", str(tmp_path / "plan.json")],
                          out=out) == 0
    text = out.getvalue()
    for s in check_gpu.SECTIONS:
        assert f"== {s.name}: " in text, s.name
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kernels"] == ["torch", "flash", "te"]
    assert len(plan["parity"]) == 2 * (3 * 2 + 3)  # 3 blocks + dacp each; te: dacp only
    cp2 = plan["training"]["cp2"]
    assert cp2[cp2.index("--nproc-per-node") + 1] == "2"
    assert cp2[cp2.index("--context-parallel-size") + 1] == "2"
    assert cp2[cp2.index("--skrull-attention-kernel") + 1] == "auto" and "--bf16" in cp2
    assert "SKRULL_DIST_BACKEND=gloo" in text and "gpu_check_cp.py attention torch" in text
    assert "--skrull-attention-kernel auto" in text and "calibrate_gpu.py" in text
    from megatron.skrull.arguments import parse_args

    for label, argv in plan["training"].items():  # the launcher accepts every flag
        flags = argv[argv.index("megatron.skrull.pretrain_gpt") + 1:]
        assert parse_args(flags, world_size=int(label[-1])).bf16
    assert parse_args(check_gpu.QWEN_FLAGS).skrull.attention_kernel == "auto"
    default = io.StringIO()
    check_gpu.main(["--dry-run"], out=default)
    assert "== train:" not in default.getvalue() and "== parity:" in default.getvalue()


def test_calibration_fits_the_gpu():
    """The calibrate_gpu hook's length and bucket follow the GPU's memory: 32768 ran out of
    an 80 GB H100's memory in GPU run 7, and fits an H200."""
    assert check_gpu.calibration_length(80 * 10**9) == 16384
    assert check_gpu.calibration_length(int(139.8 * 2**30)) == 32768
    _, _, args, _ = next(h for h in check_gpu.HOOKS if h[0] == "calibrate_gpu")
    filled = [a.format(report="r", out="o", budget="9", calib_len="16384") for a in args]
    for flag in ("--seq-length", "--skrull-bucket-size"):
        assert filled[filled.index(flag) + 1] == "16384"


def test_errors_exit_2(capsys):
    if not torch.cuda.is_available():
        assert check_gpu.main([]) == 2
        assert capsys.readouterr().err.startswith("error: no CUDA device")
    assert check_gpu.main(["--dry-run", "--kernels", "flash,xformers"]) == 2
    assert "error: unknown ['xformers']" in capsys.readouterr().err
    assert check_gpu.main(["--dry-run", "--sections", "parity,speed"]) == 2
    assert "['speed']" in capsys.readouterr().err


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(gk, "HEADS", 4)
    monkeypatch.setattr(gk, "KV_HEADS", 2)
    monkeypatch.setattr(gk, "HEAD_DIM", 8)
    monkeypatch.setattr(gk, "BLOCK_CHUNKS", (3, 1, 4, 2))
    monkeypatch.setattr(gk, "MB_LENGTHS", [5, 1, 9, 14])


def _fake_aten_kernel(monkeypatch, variant="2.13"):
    """The torch kernel over the fake ATen ops, as ``get_kernel`` returns it."""
    monkeypatch.setattr(choice, "_CACHE", {("torch", "cpu"): aten.TorchVarlenKernel(
        ops=fake_aten.ops(variant))})


@pytest.mark.parametrize("kind, version", [("flash", "2.8.3"), ("flash", "2.6.3"), ("te", "2.9"),
                                           ("torch", "2.13"), ("torch", "padded")])
def test_parity_section_through_fakes(monkeypatch, small, kind, version):
    if kind == "torch":
        _fake_aten_kernel(monkeypatch, version)
    else:
        fakes.install(monkeypatch, kind, version)
    rows = gk.parity_rows(kind, CPU, torch.float64, "fp64")
    assert len(rows) == (1 if kind == "te" else 4)
    for r in rows:
        assert r["ok"] and r["out"] < 1e-12 and r["grad"] < 1e-12, r
        assert r["lse"] is None or r["lse"] < 1e-9, r


def test_parity_section_catches_a_wrong_gradient_and_a_failing_kernel(monkeypatch, small):
    mods = fakes.install(monkeypatch, "flash", "2.8.3")
    fai = mods["flash_attn.flash_attn_interface"]
    real = fai._flash_attn_varlen_backward._init_fn

    @functools.wraps(real)  # the adapter reads the real parameters through __wrapped__
    def off_by_one_percent(*args, **kwargs):
        res = real(*args, **kwargs)
        kwargs["dq"].mul_(1.01)
        return res

    monkeypatch.setattr(fai, "_flash_attn_varlen_backward",
                        fakes.fake_flash.CustomOp("bwd", off_by_one_percent))
    rows = gk.parity_rows("flash", CPU, torch.float64, "fp64")
    assert not any(r["ok"] for r in rows) and all(r["out"] < 1e-12 for r in rows), rows
    _fake_aten_kernel(monkeypatch)
    monkeypatch.setattr(aten, "_lse_to_ours", lambda *a: (_ for _ in ()).throw(
        RuntimeError("unexpected varlen LSE shape")))
    rows = gk.parity_rows("torch", CPU, torch.float64, "fp64")
    assert all(not r["ok"] and "unexpected varlen LSE" in r["error"] for r in rows), rows


def test_timing_section_through_fakes(monkeypatch):
    _fake_aten_kernel(monkeypatch)
    fakes.install(monkeypatch, "flash", "2.8.3")
    monkeypatch.setattr(gk, "TIMING_SHAPES", (("tiny", 4, 2, 8),))
    monkeypatch.setattr(gk, "TIMING_DOCS", {"1K-32K": [5, 9, 2]})
    calls = []
    monkeypatch.setattr(gk, "_elapsed", lambda fn, repeats: calls.append(fn()) or 2.0)
    rows = gk.timing_rows(["torch", "flash"], CPU)
    assert [r["kernel"] for r in rows] == ["torch", "flash"] and all(r["ok"] for r in rows)
    flops = gk.causal_flops([5, 9, 2], 4, 8)
    assert flops == 4 * 4 * 8 * (15 + 45 + 3)
    assert rows[0]["tflops"] == pytest.approx(3.5 * flops / 4e-3 / 1e12)
    assert gk.summarize_timing(rows) == "torch tiny 4.0 ms, flash tiny 4.0 ms"
    assert len(calls) == 6  # first call, forward, backward per kernel


def test_loss_parsing_report_and_summary(tmp_path):
    line = (" [2026-11-27 10:00:00.000000] iteration        3/       8 | consumed samples:"
            "           48 | lm loss: 4.848500E+00 | grad norm: 1.9\n"
            " iteration        4/       8 | lm loss: 4.7E+00 | loss scale: 1.0")
    assert check_gpu.parse_losses(line) == [4.8485, 4.7]
    out = io.StringIO()
    rep = check_gpu.Reporter(str(tmp_path / "r.json"), str(tmp_path / "r.log"), out)
    rep.section("parity", {"status": "ok", "seconds": 3.0, "rows": [gk.row(
        "torch", "bf16", "x", 1e-3, 5e-3, gk.TOLERANCE["bf16"], 1e-3)]})
    rep.section("cp_training", {"status": "FAIL", "seconds": 9.0, "error": "boom\nlast line"})
    rep.section("cp_timing", {"status": "ok", "rows": [{"side_stream": True, "ms": 10.0},
                                                       {"side_stream": False, "ms": 13.0}]})
    assert not rep.summary()
    text = out.getvalue()
    assert "parity         ok" in text and "torch bf16 out 1.0e-03 grad 5.0e-03" in text
    assert "cp_training    FAIL" in text and "last line" in text
    assert "side stream on 10.0 ms, off 13.0 ms" in text
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["sections"]) == {"parity", "cp_training", "cp_timing"}
    assert "torch" in saved["meta"] and "summary" in (tmp_path / "r.log").read_text()


def test_budget_and_timeouts_kill_the_whole_process_group(tmp_path):
    start = time.monotonic()
    run = check_gpu._spawn(["bash", "-c", "sleep 30 & sleep 30; echo never"], 1.5)
    assert run["rc"] == "timeout" and "never" not in run["out"]
    assert time.monotonic() - start < 15  # the child's own child was killed too
    args = type("A", (), {"budget": 0, "kernels": ["torch"], "dtypes": ["bf16"]})()
    rep = check_gpu.Reporter(None, None, io.StringIO())
    check_gpu.run_sections(check_gpu.SECTIONS[:2], args, rep)
    assert all(r["status"] == "skipped" for r in rep.report["sections"].values())
    # A section runs in its own child process; what fails there is reported, not raised.
    args.budget = 120
    rep = check_gpu.Reporter(str(tmp_path / "r.json"), None, io.StringIO())
    check_gpu.run_sections([check_gpu.Section("no_such_hook", "x", 60)], args, rep)
    res = json.loads((tmp_path / "r.json").read_text())["sections"]["no_such_hook"]
    assert res["status"] == "FAIL" and "StopIteration" in res["error"], res


def test_hook_runs_a_present_script_and_skips_a_missing_one(monkeypatch, tmp_path):
    script = tmp_path / "hook.py"
    script.write_text("import json, os, sys\njson.dump({'fit': 0.9}, open(sys.argv[1], 'w'))\n"
                      "print('budget', os.environ['SKRULL_GPU_BUDGET_S'], sys.argv[2:])\n")
    monkeypatch.setenv("SKRULL_GPU_OUT", str(tmp_path))
    monkeypatch.setattr(check_gpu, "HOOKS", (("a", str(script), ["{report}", "{budget}",
                                                                 "{out}/cm.json"], 60),
                                             ("b", str(tmp_path / "missing.py"), [], 60)))
    res = check_gpu.section_hook("a", 60)  # placeholders filled: report path, budget, out folder
    assert res["ok"] and res["report"] == {"fit": 0.9}
    assert f"budget 20 ['20', '{tmp_path}/cm.json']" in res["log_tail"]
    assert check_gpu.section_hook("b", 60)["skipped"].endswith("not in this checkout")
    old = tmp_path / "old.py"  # a CPU-only version of a hook's script
    old.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    monkeypatch.setattr(check_gpu, "HOOKS", (("c", str(old), ["--device", "cuda"], 60),))
    assert check_gpu.section_hook("c", 60)["skipped"].endswith("does not take --device cuda yet")


def test_stream_order_problems_are_named():
    good = [("post", "fwd_kv"), ("wait_stream", "stream1", "main"), ("enter", "stream1"),
            ("fwd", 7, True, "stream1"), ("exit", "stream1"), ("fwd", 4, True, "main"),
            ("wait", "fwd_kv"), ("fwd", 4, False, "main"), ("wait_stream", "main", "stream1"),
            ("record_stream", "main"), ("merge", 2)]
    bwd = [(e[0].replace("fwd", "bwd"),) + tuple(
        x.replace("fwd_kv", "bwd_kv") if isinstance(x, str) else x for x in e[1:]) for e in good]
    assert gpu_check_cp.order_problems(good + bwd, 7, 2) == []
    late = good[:3] + good[5:] + [good[3]] + bwd  # the local kernel after the join
    assert "fwd: ('exit', 'stream1') missing" in gpu_check_cp.order_problems(late, 7, 2)[0]


def _cp_worker(rank, world, store, out_dir):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    gpu_check_cp.HEADS, gpu_check_cp.KV_HEADS, gpu_check_cp.HEAD_DIM = 4, 2, 8
    gpu_check_cp.LENGTHS = [5, 9, 3, 12, 7, 1, 17, 6]
    gpu_check_cp.DISTRIBUTED = [6, 7, 3]
    kernel = aten.TorchVarlenKernel(ops=fake_aten.ops())
    res = {}
    try:
        res = gpu_check_cp.attention_parity(rank, world, CPU, kernel)
        res["order"] = gpu_check_cp.stream_order(
            rank, world, CPU, kernel, make_streams=lambda device, log: FakeStreams(log))
        res["staged"] = choice is not None and gpu_check_cp.RingComm(dist.group.WORLD)._stage_device
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback
        res = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(res, f, default=str)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_cp_worker_parity_and_order_at_world_2(tmp_path):
    """What section 3 runs on the GPU, on CPU over gloo through the fake ATen kernel: bf16
    DACP at world 2 matches float64 and one process, and the overlap's order holds."""
    for rank, res in enumerate(spawn_and_collect(_cp_worker, 2, tmp_path)):
        assert "error" not in res, res.get("error")
        assert max(res["vs_fp64"].values()) < 2e-2, res
        assert max(res["vs_one_process"].values()) < 2e-2, res
        assert res["order"]["problems"] == [], res["order"]
        assert res["side_stream_off_max_diff"] == 0.0 and res["staged"]
        assert math.isfinite(res["vs_fp64"]["dk"])


def _loss_log(losses, extra=""):
    return extra + "".join(f" iteration {i + 1:8d}/{len(losses):8d} | lm loss: {x:.6E} |"
                           f" tokens/s: {5000 + i} |\n" for i, x in enumerate(losses))


def test_section_results_from_their_outputs(monkeypatch):
    """What the GPU sections conclude from their children's outputs (faked here)."""
    runs = {"cp1": {"rc": 0, "out": _loss_log([5.0, 4.5, 4.0])},
            "cp2": {"rc": 0, "out": _loss_log([5.01, 4.52, 4.01])}}
    monkeypatch.setattr(check_gpu, "_spawn_many", lambda cmds, timeout, env=None: runs)
    res = check_gpu.section_cp_training(["torch"], ["bf16"], 60)
    assert res["ok"] and res["max_rel_diff"] == pytest.approx(0.02 / 4.5, rel=1e-3)
    runs["cp2"] = {"rc": 1, "out": "Traceback...\nRuntimeError: Invalid backend"}
    res = check_gpu.section_cp_training(["torch"], ["bf16"], 60)
    assert not res["ok"] and "Invalid backend" in res["error"]
    log = _loss_log([5.1, 4.9, 4.2], "x skrull_ext.attention INFO: attention kernel auto -> "
                                     "torch on cuda\n")
    monkeypatch.setattr(check_gpu, "_spawn", lambda argv, timeout, env=None: {"rc": 0, "out": log})
    res = check_gpu.section_train(["torch"], ["bf16"], 60)
    assert res["ok"] and res["auto_kernel"] == ["torch"] and res["tokens_per_s"][-1] == 5002
    assert "auto -> torch, loss 5.10 -> 4.20, 5002 tokens/s" == check_gpu.detail("train", res)
    rank = {"backend": "gloo", "vs_fp64": {"out": 5e-3, "dq": 8e-3, "dk": 9e-3, "dv": 7e-3},
            "vs_one_process": {"out": 4e-3, "dq": 6e-3, "dk": 6e-3, "dv": 5e-3},
            "stream_order": {"problems": []}}
    monkeypatch.setattr(check_gpu, "_cp_worker", lambda what, k, t: ("torch", {
        "ranks": [rank, dict(rank, vs_fp64=dict(rank["vs_fp64"], out=3e-2))]}, ""))
    res = check_gpu.section_cp_attention(["torch"], ["bf16"], 60)
    assert not res["ok"] and res["worst"]["vs_fp64"] == 3e-2  # rank 1's output is off
    monkeypatch.setattr(check_gpu, "_cp_worker", lambda what, k, t: ("torch", {
        "ranks": [rank, rank]}, ""))
    res = check_gpu.section_cp_attention(["torch"], ["bf16"], 60)
    assert res["ok"] and check_gpu.detail("cp_attention", res).startswith(
        "torch over gloo: vs fp64 9.0e-03, vs 1 proc 6.0e-03, order ok")
