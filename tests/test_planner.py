"""The planner CLI end to end, its memory-based bucket and its error paths."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from skrull_ext.costmodel.memory import TrainingMemory
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.cli import GIB, main
from skrull_ext.scheduler import DEFAULT_POLICIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_RUN = ["--hardware", "cpu", "--dp-size", "2", "--cp-size", "2", "--global-batch-size",
             "12", "--num-batches", "2", "--backend", "python"]


def test_profile_end_to_end_writes_png_and_json(tmp_path, capsys):
    png, js = tmp_path / "plan.png", tmp_path / "plan.json"
    rc = main(["--profile", "chatqa2-long-sft", "--scale", "0.02", *SMALL_RUN,
               "--plot", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    summary = json.loads(js.read_text())
    assert set(summary["policies"]) == set(DEFAULT_POLICIES)
    assert {"dp-balanced", "dynamic-cp", "wlb-llm"} <= set(DEFAULT_POLICIES)
    sk = summary["skrull"]
    assert 0.0 <= sk["local_token_share"] <= 1.0 and sk["micro_batches_per_dp_rank"] >= 1
    assert sk["ratio_to_bound"] >= 1.0
    assert summary["policies"]["skrull"]["skrull_speedup"] == pytest.approx(1.0)
    for word in ("recommended bucket", "kept local", "micro-batches", "per-seq-cp", "figure"):
        assert word in out


def test_lengths_file_with_explicit_bucket(tmp_path, capsys):
    path = tmp_path / "lens.txt"
    path.write_text("\n".join(str(x) for x in [40, 900, 33, 2000, 75, 10, 512, 64]) + "\n")
    rc = main(["--lengths", str(path), *SMALL_RUN, "--bucket-size", "1024",
               "--policies", "per-seq-cp,kk", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["bucket_size"] == 1024 and summary["longest_that_fits"] == 2048
    assert set(summary["policies"]) == {"skrull", "per-seq-cp", "kk"}
    assert "(--bucket-size)" in capsys.readouterr().out


def _write_idx(prefix, lengths):
    """A minimal Megatron MMIDIDX v1 index (int32 tokens) written by hand."""
    n = len(lengths)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
        f.write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write((np.cumsum([0] + list(lengths[:-1])) * 4).astype("<i8").tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())


def test_megatron_data_path(tmp_path):
    prefix = str(tmp_path / "ds")
    _write_idx(prefix, [30, 300, 3000, 12, 700])
    js = tmp_path / "s.json"
    assert main(["--data-path", prefix, *SMALL_RUN, "--json", str(js)]) == 0
    assert json.loads(js.read_text())["overflow"]["count"] == 0


def test_bucket_follows_the_memory_model(tmp_path):
    js = tmp_path / "s.json"
    assert main(["--profile", "wikipedia", "--model", "qwen2.5-0.5b", "--dp-size", "4",
                 "--cp-size", "8", "--num-batches", "1", "--device-memory-gb", "80",
                 "--policies", "skrull", "--backend", "python", "--json", str(js)]) == 0
    summary = json.loads(js.read_text())
    spec = MODEL_PRESETS["qwen2.5-0.5b"]
    # No flags: Megatron's defaults (no distributed optimizer, no recompute), h100 -> bf16.
    mem = TrainingMemory(precision="bf16", dp_cp_size=32)
    static = mem.static_bytes(spec)
    want = int((80 * GIB - static - 8 * GIB) // mem.activation_bytes_per_token(spec))
    assert summary["memory"]["recommended_bucket"] == want
    # The planner keeps the fastest predicted bucket among fractions of the memory limit.
    choice = {int(c): t for c, t in summary["memory"]["bucket_choice"].items()}
    assert want in choice and len(choice) > 1 and max(choice) == want
    assert summary["bucket_size"] == min(choice, key=lambda c: (choice[c], -c))
    assert summary["memory"]["static_gib"] == pytest.approx(static / GIB)
    assert 20_000 < want < 60_000  # the paper used 26K on 80 GB


@pytest.mark.parametrize("argv,flag", [
    (["--profile", "lmsyschat1m", "--cp-size", "8", "--dp-size", "4"], "--overflow"),
    (["--profile", "chatqa2-long-sft", "--bucket-size", "4096", "--cp-size", "1"], "--cp-size"),
    (["--profile", "wikipedia", "--model", "qwen2.5-7b", "--device-memory-gb", "20"],
     "--device-memory-gb"),
    (["--profile", "wikipedia", "--cp-size", "8", "--bucket-size", "10"], "--bucket-size"),
    (["--profile", "wikipedia", "--dp-size", "0"], "--dp-size"),
    (["--profile", "wikipedia", "--policies", "skrull,fifo"], "--policies"),
    (["--profile", "wikipedia", "--scale", "-1"], "--scale"),
    (["--profile", "nope"], "--profile"),
    (["--lengths", "/nonexistent/lens.txt"], "--lengths"),
    (["--data-path", "/nonexistent/ds"], "--data-path"),
    (["--model", "qwen2.5-0.5b"], "--profile"),
    (["--profile", "wikipedia", "--model-config", "/nonexistent/m.json"], "--model-config"),
])
def test_errors_exit_2_with_one_line_naming_the_flag(argv, flag, capsys):
    try:
        rc = main(argv + ["--num-batches", "1", "--backend", "python"])
    except SystemExit as exc:  # argparse-level errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("skrull-plan: error: ")
    assert flag in err, err


def test_bad_lengths_file_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.txt"
    path.write_text("10\n20\nthirty\n")
    assert main(["--lengths", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.txt: line 3" in err and "--lengths" in err


def test_module_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "skrull_ext.planner.cli", "--profile", "wikipedia",
                           "--scale", "0.05", *SMALL_RUN, "--policies", "skrull"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skrull" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "skrull_ext.planner.cli", "--profile", "wikipedia",
                           "--cp-size", "0"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
