"""The launcher end to end: single process without torchrun (train, save, TensorBoard,
resume) and ``torchrun --standalone --nproc-per-node 2`` with CP=2."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

import skrull_ext

from mcore_helpers import TINY_FLAGS

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(cmd, timeout=120):
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _iterations(stdout):
    return [int(m) for m in re.findall(r" iteration +(\d+)/", stdout)]


def test_single_process_train_save_tensorboard_and_resume(tmp_path):
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    flags = TINY_FLAGS + ["--save", ckpt, "--save-interval", "2", "--tensorboard-dir", tb]
    first = _run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *flags,
                  "--train-iters", "3"])
    assert _iterations(first) == [1, 2, 3]
    assert "starting at iteration 0" in first
    assert f"on the {skrull_ext.BACKEND} backend" in first  # the scheduler backend is logged
    assert "predicted (ms):" in first and "local tokens:" in first
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    assert os.path.isfile(os.path.join(ckpt, "iter_0000002", "metadata.json"))  # torch_dist
    assert glob.glob(os.path.join(tb, "events.out.tfevents.*"))
    resumed = _run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *flags,
                    "--train-iters", "5", "--load", ckpt, "--override-opt_param-scheduler",
                    "--log-throughput"])
    assert "starting at iteration 3" in resumed
    assert _iterations(resumed) == [4, 5]
    # --log-throughput: Megatron's TFLOP/s per GPU field, only when asked for.
    assert "throughput per GPU (TFLOP/s/GPU):" not in first
    assert len(re.findall(r"throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|", resumed)) == 2


def test_torchrun_two_ranks_context_parallel(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m",
                "megatron.skrull.pretrain_gpt", *TINY_FLAGS, "--context-parallel-size", "2",
                "--train-iters", "2", "--skrull-bucket-size", "48"], timeout=180)
    assert "world 2 = DP 1 x CP 2 x TP 1" in out
    assert _iterations(out) == [1, 2]
    local = [float(x) for x in re.findall(r"local tokens: ([\d.]+)%", out)]
    # Samples over 48 tokens cannot be local in a 48-token bucket: the ring must run.
    assert local and min(local) < 100.0


def test_preprocessed_data_path(tmp_path):
    prefix = str(tmp_path / "synth")
    _run([sys.executable, "tools/preprocess_sft.py", "--synthetic", "40", "--seed", "3",
          "--seq-length", "96", "--synthetic-max-tokens", "97", "--output-prefix", prefix])
    flags = [f for f in TINY_FLAGS]
    out = _run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *flags, "--train-iters",
                "2", "--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"])
    assert _iterations(out) == [1, 2]
    # ByteLevelTokenizer has 262 ids -> padded to 384 (multiple of 128).
    assert re.search(r"lm loss: [5-6]\.\d+E\+00", out), out


def test_bad_data_path_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY_FLAGS,
                           "--data-path", str(tmp_path / "missing")], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing" in errors[0], proc.stderr[-2000:]
