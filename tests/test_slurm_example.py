"""examples/slurm/sft.sbatch as a dry run with fake Slurm variables: the srun command, and
each node's launcher command (torchrun's flags from Slurm's variables, pretrain_gpt's flags
valid for the whole world)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from megatron.skrull.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "slurm", "sft.sbatch")
NODE_SCRIPT = os.path.join(ROOT, "examples", "run_gpu_multinode.sh")
GPUS = 8


def _dry_run(tmp_path, nodelist, nnodes, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "NODE_RANK", "NNODES", "JOB_ID"))}
    env.update(DRY_RUN="1", SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(nnodes),
               SLURM_JOB_ID="31337", SLURM_NODEID="0", PYTHON=sys.executable,
               DATA_PATH="data/chatqa2", TOKENIZER_MODEL="tok.json", **extra)
    # Run from elsewhere: the script finds the repository itself.
    return subprocess.run(["bash", SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def _commands(stdout):
    """``(srun argv, [(node, host, launcher argv)])`` of a dry run's output."""
    lines = stdout.strip().splitlines()
    nodes = []
    for header, command in zip(lines[1::2], lines[2::2]):
        assert header.startswith("# node "), lines
        node, host = header[len("# node "):].rstrip("):").split(" (")
        nodes.append((int(node), host, shlex.split(command)))
    return shlex.split(lines[0]), nodes


def _check_nodes(nodes, hosts, port):
    from torch.distributed.run import parse_args as torchrun_parse_args

    assert [(n, h) for n, h, _ in nodes] == list(enumerate(hosts))
    for node, _, argv in nodes:
        assert argv[:3] == [sys.executable, "-m", "megatron.skrull.launch"]
        launcher = torchrun_parse_args(argv[3:])
        assert (launcher.nnodes, launcher.node_rank, launcher.nproc_per_node) == (
            str(len(hosts)), node, str(GPUS))
        assert (launcher.rdzv_backend, launcher.rdzv_id) == ("c10d", "31337")
        assert launcher.rdzv_endpoint == f"{hosts[0]}:{port}"
        assert launcher.module and launcher.training_script == "megatron.skrull.pretrain_gpt"
        cfg = parse_args(launcher.training_script_args, world_size=len(hosts) * GPUS)
        assert (cfg.parallel.dp_size, cfg.parallel.context_parallel_size) == (len(hosts), 8)


def test_dry_run_expands_the_nodelist_in_python_without_scontrol(tmp_path):
    proc = _dry_run(tmp_path, "gpu[07-08,10],big-node3", 4, SCONTROL="/nonexistent/scontrol")
    assert proc.returncode == 0, proc.stderr
    srun, nodes = _commands(proc.stdout)
    assert srun[:6] == ["srun", "--nodes", "4", "--ntasks-per-node", "1",
                        "--kill-on-bad-exit=1"]
    assert srun[-4:-1] == ["bash", "-c", 'NODE_RANK="$SLURM_NODEID" exec bash "$0"']
    assert srun[-1] == NODE_SCRIPT
    _check_nodes(nodes, ["gpu07", "gpu08", "gpu10", "big-node3"], 20000 + 31337 % 20000)
    # The task srun starts on node 2 runs the node script with NODE_RANK = SLURM_NODEID.
    probe = tmp_path / "probe.sh"
    probe.write_text('echo "rank=$NODE_RANK"\n')
    task = subprocess.run([*srun[-4:-1], str(probe)], env={**os.environ, "SLURM_NODEID": "2"},
                          capture_output=True, text=True, timeout=30)
    assert task.stdout.strip() == "rank=2"


def test_dry_run_uses_scontrol_and_overrides(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && [ "$3" = "n[1-2]" ] '
                    '&& printf "alpha\\nbeta\\n"\n')
    fake.chmod(0o755)
    proc = _dry_run(tmp_path, "n[1-2]", 2, MASTER_PORT="6001",
                    PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    _, nodes = _commands(proc.stdout)
    _check_nodes(nodes, ["alpha", "beta"], 6001)


@pytest.mark.parametrize("nodelist, nnodes, needle", [
    ("gpu[01-04]", 3, "names 4 hosts but SLURM_NNODES=3"),
    ("", 2, "submit with sbatch"),
])
def test_dry_run_bad_allocation_is_one_error_line(tmp_path, nodelist, nnodes, needle):
    proc = _dry_run(tmp_path, nodelist, nnodes, SCONTROL="/nonexistent/scontrol")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("sft.sbatch: error:") and needle in line
    assert proc.stdout == ""
