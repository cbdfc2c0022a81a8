"""Megatron-LM's example scripts run as written (sizes scaled) on CPU in one process.

One launch (tests/_megatron_scripts.py) runs five command lines through the launcher:
the Llama-3 8B fp8 script (one refusal line: no fp8 here), the same with its DTYPE switch
off, the GPT-3 175B script (one refusal line: its batch-size ramp), the same without the
ramp line, and the Qwen2.5-7B model flags.  The runs train two iterations each; the log
shows the accepted flags' notes once, the mapped attention back-end, and Megatron-LM's
sample-based LR schedule.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _errors(run: dict) -> list[str]:
    return [line for line in run["stderr"].splitlines() if "error:" in line]


def _lrs(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| lr ([0-9.E+-]+) \|", stdout)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("megatron_scripts"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_megatron_scripts.py"), tmp],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(tmp, "results.json")) as f:
        return json.load(f), tmp


def test_fp8_script_without_transformer_engine_is_one_line(runs):
    results, _ = runs
    run = results["llama_fp8"]
    assert run["rc"] == 2 and len(_errors(run)) == 1, run["stderr"]
    assert "--fp8-format" in _errors(run)[0] and "Transformer Engine" in _errors(run)[0]


def test_batch_size_ramp_is_one_line(runs):
    results, _ = runs
    run = results["gpt3_ramp"]
    assert run["rc"] == 2 and len(_errors(run)) == 1, run["stderr"]
    assert "--step-batch-size-schedule" in _errors(run)[0]


@pytest.mark.parametrize("name", ["llama", "gpt3", "qwen"])
def test_script_trains(runs, name):
    results, _ = runs
    run = results[name]
    assert run["rc"] == 0, run["stdout"][-2000:] + run["stderr"][-2000:]
    assert re.findall(r" iteration +(\d+)/", run["stdout"])[-1] == "2"
    # Every accepted reason is one line, printed once.
    notes = re.findall(r" skrull: accepted Megatron-LM flags? (.*?): ", run["stdout"])
    assert notes and len(notes) == len(set(notes)), notes


def test_llama_script_details(runs):
    results, tmp = runs
    out = results["llama"]["stdout"]
    assert "--manual-gc, --empty-unused-memory-level" in out
    assert "--attention-backend fused -> --skrull-attention-kernel torch on cpu" in out
    # --train-samples 8 / --global-batch-size 4 = 2 iterations; the LR schedule counts
    # samples: warmup 2, decay 7 (cosine), so iteration 2 (4 samples seen) has
    # min + (max - min) * (1 + cos(pi * (4 - 2) / (7 - 2))) / 2.
    lrs = _lrs(out)
    lr_max, lr_min = 1.5e-4, 1e-5
    expected = lr_min + (lr_max - lr_min) * (1 + math.cos(math.pi * 2 / 5)) / 2
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(expected, rel=1e-3), lrs
    assert open(f"{tmp}/llama_ckpt/latest_checkpointed_iteration.txt").read() == "2"


def test_gpt3_and_qwen_details(runs):
    results, _ = runs
    gpt3, qwen = results["gpt3"]["stdout"], results["qwen"]["stdout"]
    assert "accepted Megatron-LM flags --vocab-file, --merge-file: tokenizer files" in gpt3
    assert "--attention-backend auto -> --skrull-attention-kernel auto on cpu" in gpt3
    assert "--no-masked-softmax-fusion, --no-bias-swiglu-fusion: fusion" in qwen
    assert "without --group-query-attention" not in qwen  # the script says GQA
