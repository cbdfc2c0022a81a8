"""Megatron-LM's example scripts run as written (sizes scaled) on CPU in one process.

One launch (tests/_megatron_scripts.py) runs six command lines through the launcher:
the Llama-3 8B fp8 script (one refusal line: no fp8 here), the same with its DTYPE switch
off, the GPT-3 175B script (its --step-batch-size-schedule scaled so the global batch grows
1, 1, 2, 3, 4 over six iterations), the Qwen2.5-7B model flags and both cases of
Megatron-LM dev's dynamic-CP benchmark.  The log shows the
accepted flags' notes once, the mapped attention back-end, Megatron-LM's sample-based LR
schedule and the global batch size of each iteration.
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
    return [float(x) for x in re.findall(r"\| learning rate: ([0-9.E+-]+) \|", stdout)]


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


def test_gpt3_script_ramps_the_global_batch_as_written(runs):
    results, tmp = runs
    out = results["gpt3"]["stdout"]
    # Megatron's "global batch size: N" of iterations 1..6 under "0:1 0.256K:2 0.512K:3
    # 0.768K:4" at 128 tokens per sample: consumed 0, 1, 2, 4, 7, 11 samples before each.
    sizes = [int(n) for n in re.findall(r"\| global batch size: +(\d+) \|", out)]
    assert sizes == [1, 1, 2, 3, 4, 4], out[-3000:]
    assert "1 from 0, 2 from 2, 3 from 4, 4 from 6" in out
    # Megatron-LM saves a checkpoint before each change of the batch size (and at the end).
    saved = sorted(d for d in os.listdir(f"{tmp}/gpt3_ckpt") if d.startswith("iter_"))
    assert saved == ["iter_0000002", "iter_0000003", "iter_0000004", "iter_0000006"]


@pytest.mark.parametrize("name,iters", [("llama", "2"), ("gpt3", "6"), ("qwen", "2"),
                                        ("dcp_baseline", "3"), ("dcp", "3")])
def test_script_trains(runs, name, iters):
    results, _ = runs
    run = results[name]
    assert run["rc"] == 0, run["stdout"][-2000:] + run["stderr"][-2000:]
    assert re.findall(r" iteration +(\d+)/", run["stdout"])[-1] == iters
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
    # Megatron's health fields: fp16's dynamic scaler (2^32 at start, hysteresis 2) skips
    # the overflowing steps and halves; bf16 never scales or skips.
    health = r"loss scale: ([\d.]+) \| grad norm: [\d.]+ \| number of skipped iterations: +(\d+)"
    scales = [(float(x), int(k)) for x, k in re.findall(health, gpt3)]
    assert scales[:3] == [(2.0 ** 32, 1), (2.0 ** 31, 1), (2.0 ** 30, 1)], scales
    assert re.findall(health, qwen) == [("1.0", "0")]
    assert "accepted Megatron-LM flags --vocab-file, --merge-file: tokenizer files" in gpt3
    assert "--attention-backend auto -> --skrull-attention-kernel auto on cpu" in gpt3
    assert "--no-masked-softmax-fusion, --no-bias-swiglu-fusion: fusion" in qwen
    assert "without --group-query-attention" not in qwen  # the script says GQA


def test_dynamic_cp_benchmark_cases_map_to_megatrons_schedulers(runs):
    """Megatron-LM dev's dynamic-CP example: its baseline runs dp-balanced, its dynamic-CP
    case the DP x CP pool with dynamic-cp, on Megatron's mock lengths; the first iteration's
    loss does not depend on the packing (the same samples, per-token loss)."""
    results, _ = runs
    base, dcp = results["dcp_baseline"]["stdout"], results["dcp"]["stdout"]
    assert "scheduler dp-balanced" in base and "scheduler dynamic-cp" in dcp
    assert "Megatron's hybrid/dynamic CP: the DP x CP ranks form one pool" in dcp
    assert "--save-interval 1000000 without --save: no checkpoints" in base
    first = [re.search(r"iteration +1/ +3 \|.*? lm loss: ([0-9.E+-]+)", out).group(1)
             for out in (base, dcp)]
    assert float(first[0]) == pytest.approx(float(first[1]), rel=1e-3), first
