"""Checkpoints that change the optimizer or the tensor-parallel layout on resume.

One spawn of 2 gloo ranks.  Saved with the distributed optimizer at DP 2, resumed with it
at DP 2 and CP 2, without it at DP 2 and at TP 2 (the tensor-parallel reshard); saved
without it at TP 2 and resumed with it at DP 2.  Every resumed fp64 run must give the
uninterrupted run's losses.  The distributed optimizer's fully reshardable format holds
the main parameters and Adam moments in fp32 (mcore's canonical precision), so the fp64
runs that cross it match to 1e-9 in the losses rather than bit for bit.  A bf16 pair
covers the 16-bit optimizer's own layout (main params under ``fp32_param``).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from mcore_helpers import spawn
from test_checkpointing import FLAGS, _load, _setup, _train

pytestmark = pytest.mark.multiprocess

# Divisible-by 32 pads the tiny vocabulary to 64 rows at TP 1 and at TP 2: a TP change
# that changes the padding keeps the extra rows' initial values, as in Megatron-LM.
BASE = FLAGS + ["--make-vocab-size-divisible-by", "32"]
DIST = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]
BF16 = [f for f in BASE if f != "--fp64"] + ["--bf16"]


def _resume(tmp, name, save_flags, resumes):
    """Saves 2 iterations with ``save_flags``; resumes each ``(key, flags)``; returns
    ``{"full": 4 uninterrupted losses, key: [resumed iteration, losses 3-4]}``."""
    from mcore_helpers import tiny_config

    cfg = tiny_config(save_flags, world_size=2)
    out = {"full": _train(_setup(cfg), 4)}
    _train(_setup(cfg), 2, save_to=f"{tmp}/{name}", cfg=cfg)
    for key, flags in resumes:
        c = tiny_config(flags, world_size=2)
        trainer = _setup(c)
        out[key] = [_load(f"{tmp}/{name}", trainer, c), _train(trainer, 4)]
    return out


def _worker(rank, world, tmp):
    out = {
        "dist": _resume(tmp, "dist", BASE + DIST, [
            ("same", BASE + DIST), ("cp", BASE + DIST + ["--context-parallel-size", "2"]),
            ("plain", BASE), ("tp", BASE + TP2)]),
        "tp": _resume(tmp, "tp", BASE + TP2, [("dist", BASE + DIST)]),
        "bf16": _resume(tmp, "bf16", BF16 + DIST, [("plain", BF16)]),
    }
    with open(os.path.join(tmp, f"out{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    spawn(_worker, 2, tmp, timeout=600)
    return [json.load(open(tmp / f"out{r}.json")) for r in range(2)]


@pytest.mark.parametrize("key", ["same", "cp", "plain", "tp"])
def test_distributed_optimizer_checkpoint_resumes_anywhere(runs, key):
    for r in runs:
        full = r["dist"]["full"]
        at, losses = r["dist"][key]
        assert at == 2
        torch.testing.assert_close(losses, full[2:], rtol=1e-9, atol=0)


def test_tensor_parallel_checkpoint_resumes_with_distributed_optimizer(runs):
    for r in runs:
        at, losses = r["tp"]["dist"]
        assert at == 2
        torch.testing.assert_close(losses, r["tp"]["full"][2:], rtol=1e-9, atol=0)


def test_bf16_distributed_checkpoint_resumes_with_plain_optimizer(runs):
    for r in runs:
        at, losses = r["bf16"]["plain"]
        full = r["bf16"]["full"]
        assert at == 2
        # Iteration 3 sees only the bf16 weights: exact.  Iteration 4 also the optimizer
        # step, where the plain optimizer all-reduces the gradients that the distributed
        # one reduce-scatters (another summation order).
        assert losses[0] == full[2]
        torch.testing.assert_close(losses[1], full[3], rtol=1e-3, atol=0)
