"""tools/check_gpu.py: the CPU dry run, its errors, and its parity code driven through the
fakes of flash-attn and Transformer Engine (small shapes, float64)."""
import functools
import io
import json
import os
import sys

import pytest
import torch

import fakes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import check_gpu  # noqa: E402


def test_dry_run_plans_every_section(tmp_path):
    out = io.StringIO()
    assert check_gpu.main(["--dry-run", "--json", str(tmp_path / "plan.json")], out=out) == 0
    text = out.getvalue()
    for section in ("== 1. kernel parity", "== 2. training loss parity", "== 3. DACP attention"):
        assert section in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kernels"] == ["flash", "te"] and plan["dtypes"] == ["bf16", "fp16"]
    assert len(plan["parity"]) == 2 * (3 + 1) + 2 * 1  # flash: 3 blocks + dacp; te: dacp
    cp2 = plan["training"]["te"]["cp2"]
    assert cp2[cp2.index("--nproc-per-node") + 1] == "2"
    assert cp2[cp2.index("--context-parallel-size") + 1] == "2"
    assert cp2[cp2.index("--skrull-attention-kernel") + 1] == "te"
    assert "--device" in cp2 and cp2[cp2.index("--device") + 1] == "cuda"
    assert plan["timing"]["flash"][-2:] == ["--worker-timing", "flash"]
    # The timed micro-batch really mixes: both ranks hold local and distributed tokens.
    assert "rank 1:" in text and "+ 16384 distributed" in text


def test_errors_exit_2(capsys):
    if not torch.cuda.is_available():
        assert check_gpu.main([]) == 2
        assert capsys.readouterr().err.startswith("error: no CUDA device")
    assert check_gpu.main(["--dry-run", "--kernels", "flash,cudnn"]) == 2
    assert "error: unknown ['cudnn']" in capsys.readouterr().err


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(check_gpu, "HEADS", 4)
    monkeypatch.setattr(check_gpu, "KV_HEADS", 2)
    monkeypatch.setattr(check_gpu, "HEAD_DIM", 8)
    monkeypatch.setattr(check_gpu, "BLOCK_CU", (0, 6, 7, 16, 20))
    monkeypatch.setattr(check_gpu, "MB_LENGTHS", [5, 1, 9, 14])


@pytest.mark.parametrize("kind, version", [("flash", "2.8.3"), ("flash", "2.6.3"), ("te", "2.9")])
def test_parity_section_through_fakes(monkeypatch, small, kind, version):
    fakes.install(monkeypatch, kind, version)
    rows = check_gpu.parity_rows(kind, torch.device("cpu"), torch.float64, "fp64")
    assert len(rows) == (4 if kind == "flash" else 1)
    for r in rows:
        assert r["ok"] and r["out"] < 1e-12 and r["grad"] < 1e-12, r


def test_parity_section_catches_a_wrong_gradient(monkeypatch, small):
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
    rows = check_gpu.parity_rows("flash", torch.device("cpu"), torch.float64, "fp64")
    assert not any(r["ok"] for r in rows) and all(r["out"] < 1e-12 for r in rows), rows


def test_loss_parsing_and_report():
    line = (" iteration        3/       8 | loss 4.848500E+00 | lr 5.000E-04 | grad norm 1.9\n"
            " iteration        4/       8 | loss 4.7E+00 | lr 0")
    assert check_gpu.parse_losses(line) == [4.8485, 4.7]
    out = io.StringIO()
    ok = check_gpu.report({
        "parity": [check_gpu._row("flash", "bf16", "x", 1e-3, 5e-3, check_gpu.TOLERANCE["bf16"])],
        "training": [{"kernel": "te", "ok": True, "max_rel_diff": 1e-3}],
        "timing": {"flash": [{"side_stream": True, "ms": 10.0},
                             {"side_stream": False, "ms": 13.0}]}}, out)
    assert ok and "flash | 10.00 | 13.00 | 1.30x" in out.getvalue()
    assert not check_gpu.report({"parity": [], "training": [{"kernel": "te", "ok": False,
                                                             "error": "boom"}],
                                 "timing": {}}, io.StringIO())
