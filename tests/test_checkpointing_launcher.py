"""The launcher's checkpoint behaviour as a user meets it: SIGTERM saves and exits 0, a save
killed with SIGKILL loses nothing written before, bad ``--load`` input is one line, exit 2."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mcore_helpers import TINY_FLAGS

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACKER = "latest_checkpointed_iteration.txt"


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    return env


def _cmd(*flags):
    return [sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY_FLAGS, *flags]


def _run(*flags, timeout=240):
    return subprocess.run(_cmd(*flags), env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _start_and_signal(flags, sig, after_line, timeout=240):
    """Starts a launch, sends ``sig`` once ``after_line`` matches a stdout line."""
    proc = subprocess.Popen(_cmd(*flags), env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(after_line, line):
                proc.send_signal(sig)
                break
            assert time.monotonic() < deadline, "".join(lines)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines) + out, err


def _error_lines(stderr):
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_sigterm_saves_at_the_next_iteration_and_exits_zero(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    rc, out, err = _start_and_signal(
        ["--save", ckpt, "--exit-signal-handler", "--train-iters", "500"], signal.SIGTERM,
        r" iteration +2/")
    assert rc == 0, err[-2000:]
    assert "SIGTERM received" in err
    last = max(int(m) for m in re.findall(r" iteration +(\d+)/", out))
    saved = int(open(os.path.join(ckpt, TRACKER)).read())
    assert 2 <= saved < 500 and saved >= last
    assert os.path.isfile(os.path.join(ckpt, f"iter_{saved:07d}", "metadata.json"))


def test_sigkill_mid_save_loses_nothing_and_resume_works(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # Saving every iteration, the kill usually lands inside a save; either way nothing that
    # the tracker named before may be lost (tests/test_checkpointing.py covers the debris).
    rc, out, _ = _start_and_signal(["--save", ckpt, "--save-interval", "1", "--train-iters",
                                    "500"], signal.SIGKILL, r" iteration +3/")
    assert rc == -signal.SIGKILL
    saved = int(open(os.path.join(ckpt, TRACKER)).read())
    assert saved >= 2  # iterations 1, 2 were saved before 3 was logged
    assert os.path.isfile(os.path.join(ckpt, f"iter_{saved:07d}", "metadata.json"))
    resumed = _run("--save", ckpt, "--load", ckpt, "--train-iters", str(saved + 1),
                   "--use-checkpoint-opt_param-scheduler")  # stop early, same schedule
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"starting at iteration {saved}" in resumed.stdout
    assert open(os.path.join(ckpt, TRACKER)).read() == str(saved + 1)
    # The same checkpoint under another model's flags: one error line, exit 2.
    other = _run("--load", ckpt, "--hidden-size", "32")
    assert other.returncode == 2
    (line,) = _error_lines(other.stderr)
    assert "another model" in line and "hidden_size" in line


def test_load_of_a_missing_directory_is_an_error(tmp_path):
    proc = _run("--load", str(tmp_path / "typo"))
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert "no such directory" in line and "typo" in line
