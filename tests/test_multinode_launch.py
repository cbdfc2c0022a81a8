"""The multi-node launch path on one machine: two "nodes" of 2 processes each
(``python -m megatron.skrull.launch``, torchrun with the failing rank's exit status)
meet through a c10d rendezvous (world 4 = DP 2 x CP 2) and train the same losses as one
process (float64, so the comparison is tight)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from mcore_helpers import TINY_FLAGS

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 180
ITERS = 3
FLAGS = [*TINY_FLAGS, "--fp64", "--train-iters", str(ITERS), "--global-batch-size", "8",
         "--skrull-bucket-size", "128", "--mock-num-samples", "32"]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _free_port() -> int:
    # Bind to port 0 and release it: the OS picks a port nobody holds right now.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(text: str) -> dict[int, float]:
    return {int(it): float(loss) for it, loss in
            re.findall(r" iteration +(\d+)/ *\d+ \|.*? lm loss: ([-+.\dE]+)", text)}


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers (own session)
        proc.wait()


def test_two_nodes_of_two_processes_match_one_process(tmp_path):
    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    procs, logs = [], []
    try:
        for node_rank in (0, 1):
            log = tmp_path / f"node{node_rank}.log"
            logs.append(log)
            cmd = [sys.executable, "-m", "megatron.skrull.launch", "--nnodes", "2",
                   "--node-rank", str(node_rank), "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                   "--rdzv-id", run_id, "--local-addr", "127.0.0.1",  # no hostname lookup
                   "-m", "megatron.skrull.pretrain_gpt", *FLAGS, "--context-parallel-size", "2"]
            with open(log, "w") as out:
                procs.append(subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=out,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True))
        # One process of the same run while the nodes work (it needs no port).
        single = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *FLAGS],
                                env=_env(), cwd=ROOT, capture_output=True, text=True,
                                timeout=TIMEOUT_S)
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            _kill(p)
    text = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-4000:]
    assert single.returncode == 0, single.stderr[-3000:]
    # Global rank 0 (which prints) may be on either "node": the rendezvous assigns ranks.
    assert "world 4 = DP 2 x CP 2 x TP 1" in text, text[-4000:]
    multi, ref = _losses(text), _losses(single.stdout)
    assert sorted(multi) == list(range(1, ITERS + 1)), text[-4000:]
    assert sorted(ref) == list(range(1, ITERS + 1)), single.stdout[-3000:]
    for it in ref:  # printed with 7 significant digits
        assert multi[it] == pytest.approx(ref[it], rel=2e-6), (it, multi, ref)
    assert multi[ITERS] < multi[1]
