"""The example launch scripts: the quick start / CPU demo end to end on a tiny corpus, and
the multi-node GPU script's flags (it cannot run here, so its torchrun and pretrain_gpt
arguments are parsed instead)."""
from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from megatron.skrull.arguments import parse_args
from megatron.skrull.batch_schedule import model_spec
from skrull_ext.costmodel.model import MODEL_PRESETS

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_SCRIPT = os.path.join(ROOT, "examples", "run_gpu_multinode.sh")


def _env(**overrides):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "PYTHONWARNINGS", "RESUME", "ITERS", "CP", "NPROC", "SCHEDULER")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(overrides)
    return env


def _bash(script, env, timeout=300):  # hang guard, not a timing claim
    return subprocess.run(["bash", os.path.join(ROOT, "examples", script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _iterations(stdout):
    return [int(m) for m in re.findall(r" iteration +(\d+)/ *\d+ \|.*? lm loss: ", stdout)]


def _fake_venv(path):
    """A venv stand-in that runs this interpreter (and refuses pip, so an install attempt
    can never touch the shared environment)."""
    python = path / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "no pip in tests" >&2; '
                      f'exit 97; fi\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return path


def _mark_installed(venv):
    """Records the install inputs' hash as a finished scripts/install.sh does."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install.sh"), "--hash"],
                          env=_env(SKRULL_VENV=str(venv)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (venv / ".skrull-install-hash").write_text(proc.stdout)


def test_install_is_skipped_only_when_its_inputs_are_unchanged(tmp_path):
    venv = _fake_venv(tmp_path / "venv")
    env = _env(SKRULL_VENV=str(venv))
    script = os.path.join(ROOT, "scripts", "install.sh")
    first = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=180)
    # Not installed yet: step 1 runs and reaches pip (the fake refuses it).
    assert first.returncode == 97 and "== install [1/4" in first.stdout, first.stdout
    assert not (venv / ".skrull-install-hash").exists()
    _mark_installed(venv)
    second = subprocess.run(["bash", script], env=env, capture_output=True, text=True,
                            timeout=180)
    assert second.returncode == 0 and "is up to date" in second.stdout, second.stdout
    (venv / ".skrull-install-hash").write_text("stale\n")  # e.g. csrc/ changed since
    assert subprocess.run(["bash", script, "--check"], env=env, timeout=180).returncode == 1


def test_quickstart_and_cpu_demo_train_save_and_resume(tmp_path):
    run_dir = tmp_path / "demo"
    small = dict(RUN_DIR=str(run_dir), DEMO_SAMPLES="120", SEQ_LENGTH="1024", GBS="8",
                 LOG_INTERVAL="1")
    # quickstart.sh: the venv already runs this checkout -> no install, straight to the demo.
    venv = _fake_venv(tmp_path / "venv")
    _mark_installed(venv)
    env = _env(SKRULL_VENV=str(venv), ITERS="3", **small)
    first = _bash("quickstart.sh", env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    assert "is up to date" in out
    assert "world 2 = DP 1 x CP 2 x TP 1" in out and "scheduler skrull" in out
    assert _iterations(out) == [1, 2, 3]
    assert "UserWarning" not in first.stderr  # the expected CPU fallback notices are muted
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ckpt / "iter_0000003" / "metadata.json").is_file()  # torch_dist checkpoint
    assert _iterations((run_dir / "train.log").read_text()) == [1, 2, 3]
    assert f"checkpoint:  {ckpt} (iteration 3" in out
    # run_cpu_demo.sh again: reuses the corpus and continues the checkpoint.
    env = _env(PYTHON=sys.executable, ITERS="5", RESUME="1", SCHEDULER="sorted", **small)
    second = _bash("run_cpu_demo.sh", env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "== data: reusing" in second.stdout
    assert "starting at iteration 3" in second.stdout and "scheduler sorted" in second.stdout
    assert _iterations(second.stdout) == [4, 5]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    log = (run_dir / "train.log").read_text()
    assert log.count("==== run of ") == 2 and _iterations(log) == [1, 2, 3, 4, 5]  # appended
    # Starting over with a setting only the ranks can find wrong (the tokenizer file): one
    # line from rank 0 through the launcher, status 2, and the last checkpoint is back.
    env = _env(PYTHON=sys.executable, ITERS="2", **small,
               EXTRA_ARGS="--tokenizer-type HFTokenizer --tokenizer-model /nonexistent/tok.json")
    third = _bash("run_cpu_demo.sh", env)
    assert third.returncode == 2, third.stdout[-3000:] + third.stderr[-3000:]
    errors = [ln for ln in third.stdout.splitlines() + third.stderr.splitlines()
              if "error:" in ln]
    assert len(errors) == 1 and "/nonexistent/tok.json" in errors[0], third.stdout + third.stderr
    assert "Traceback" not in third.stdout + third.stderr
    assert "ChildFailedError" not in third.stdout + third.stderr
    assert "restored the previous checkpoint" in third.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not (run_dir / "ckpt.previous").exists()
    assert (run_dir / "train.log").read_text().count("==== run of ") == 3


@pytest.mark.parametrize("overrides, message", [
    (dict(NPROC="2", CP="3"), "NPROC=2 is not a multiple of CP=3"),
    (dict(ITERS="0"), "ITERS=0 must be a positive integer"),
    (dict(PYTHON="/nonexistent/python"), "PYTHON=/nonexistent/python is not an interpreter"),
    (dict(COST_MODEL="/nonexistent.json"), "COST_MODEL=/nonexistent.json: no such file"),
])
def test_cpu_demo_rejects_bad_settings_with_one_line(tmp_path, overrides, message):
    env = _env(**{"PYTHON": sys.executable, "RUN_DIR": str(tmp_path / "demo"), **overrides})
    proc = _bash("run_cpu_demo.sh", env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"run_cpu_demo.sh: error: {message}"), lines
    assert not (tmp_path / "demo").exists()  # failed before touching anything


@pytest.mark.parametrize("overrides, message", [
    (dict(SCHEDULER="fastest"), "invalid choice: 'fastest'"),
    (dict(EXTRA_ARGS="--bucket-size 8"), "unrecognized arguments: --bucket-size"),
    (dict(BUCKET="3"), "--skrull-bucket-size 3 is smaller than 2 x --context-parallel-size"),
    (dict(RESUME="1", RUN_DIR="{tmp}/empty"), "RESUME=1 but"),
])
def test_cpu_demo_checks_every_flag_before_touching_the_checkpoint(tmp_path, overrides,
                                                                   message):
    run_dir = tmp_path / "demo"
    (run_dir / "ckpt").mkdir(parents=True)
    (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    overrides = {k: v.format(tmp=tmp_path) for k, v in overrides.items()}
    env = _env(**{"PYTHON": sys.executable, "RUN_DIR": str(run_dir), **overrides})
    proc = _bash("run_cpu_demo.sh", env, timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and message in lines[0], lines
    assert sorted(os.listdir(run_dir)) == ["ckpt"]  # no data, log or move
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "7"


def _gpu_command(**overrides):
    env = _env(DRY_RUN="1", DATA_PATH="data/chatqa2",
               TOKENIZER_MODEL="Qwen2.5-0.5B/tokenizer.json", **overrides)
    proc = subprocess.run(["bash", GPU_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


@pytest.mark.parametrize("nnodes, gpus, dp", [(4, 8, 4), (2, 8, 2), (1, 8, 1)])
def test_gpu_multinode_script_flags_parse(nnodes, gpus, dp):
    from torch.distributed.run import parse_args as torchrun_parse_args

    argv = _gpu_command(NNODES=str(nnodes), GPUS_PER_NODE=str(gpus), NODE_RANK="1",
                        MASTER_ADDR="node0", MASTER_PORT="29400")
    assert argv[1:3] == ["-m", "megatron.skrull.launch"]  # torchrun's flags
    launcher = torchrun_parse_args(argv[3:])
    assert (launcher.nnodes, launcher.node_rank, launcher.nproc_per_node) == (str(nnodes), 1, str(gpus))
    assert (launcher.rdzv_backend, launcher.rdzv_endpoint) == ("c10d", "node0:29400")
    assert launcher.module and launcher.training_script == "megatron.skrull.pretrain_gpt"

    cfg = parse_args(launcher.training_script_args, world_size=nnodes * gpus)
    assert (cfg.parallel.dp_size, cfg.parallel.context_parallel_size) == (dp, 8)
    assert cfg.skrull.bucket_size == 26000 and cfg.skrull.scheduler == "skrull"
    assert cfg.data.tokenizer_type == "HFTokenizer" and not cfg.data.use_mock
    assert cfg.data.tokenizer_model == "Qwen2.5-0.5B/tokenizer.json"
    assert cfg.checkpoint.save == cfg.checkpoint.load and cfg.logging.tensorboard_dir
    assert cfg.device == "auto" and not cfg.fp64 and cfg.bf16
    # The architecture is the paper's Qwen2.5-0.5B (the cost model's preset).
    ours, qwen = model_spec(cfg, 151936), MODEL_PRESETS["qwen2.5-0.5b"]
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "swiglu"):
        assert getattr(ours, field) == getattr(qwen, field), field
    assert cfg.model.add_qkv_bias and cfg.model.normalization == "RMSNorm"


def test_gpu_multinode_script_needs_data_and_tokenizer():
    env = _env(DRY_RUN="1", TOKENIZER_MODEL="t.json")
    env.pop("DATA_PATH", None)
    proc = subprocess.run(["bash", GPU_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "set DATA_PATH" in proc.stderr
