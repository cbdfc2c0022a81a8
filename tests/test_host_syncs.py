"""A training step reads nothing back from the device per layer or per micro-batch, and
moves each micro-batch to the device in one copy (issue 27: the step was host-bound on an
H200, with 182 ``cudaStreamSynchronize`` per step).

On CPU there is no device to wait for, so the tests count what WOULD sync on CUDA, over one
launcher step (``Trainer.run_plan``: forward, selective recompute, backward, clipping, the
bf16 optimizer) of the tiny model with 2 and with 4 layers, a plan of several micro-batches:

* every call in ``skrull_ext`` / ``megatron.skrull`` that names a device or reads a tensor
  (``.to(device)``, ``.cpu()``, ``.item()``, ``bool()``/``int()``/``float()`` of a tensor,
  ``torch.tensor(..., device=)``): exactly one staging copy per micro-batch and one loss
  read per iteration, for any number of layers;
* every ``aten::_local_scalar_dense`` / ``is_nonzero`` / ``nonzero`` anywhere (mcore's code
  included, e.g. its grad-norm fallback read one norm per parameter): as many with 4 layers
  as with 2.  Two sources are host tensors on every device and are left out: torch's AdamW
  step counters (CPU tensors unless ``capturable``) and mcore's ``attn_mask_type`` of the
  selective recompute (``torch.tensor([...])`` on the CPU).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import sys
from unittest import mock

import pytest

from mcore_helpers import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = ("skrull_ext", "megatron.skrull")
READS = ("item", "tolist", "numpy", "cpu", "cuda", "__bool__", "__int__", "__float__")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero")
HOST_ONLY = ("torch/optim/", "megatron/core/transformer/attention.py")
_FRAME = re.compile(r"^(.*)\((\d+)\): (.*)$")


def _caller_module():
    """Module of the first frame outside torch and the CPU shims' function mode."""
    import sys as _sys

    f = _sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith(
            ("torch", "megatron.skrull.cpu_compat", "contextlib", "unittest")):
        f = f.f_back
    return f.f_globals.get("__name__", "") if f is not None else ""


@contextlib.contextmanager
def device_calls():
    """Counts ``(module, call)`` of our code's calls that name a device or read a tensor."""
    import torch

    counts = collections.Counter()

    def wrap(name, orig):
        def call(*args, **kwargs):
            mod = _caller_module()
            names_device = "device" in kwargs or any(
                isinstance(a, (torch.device, str)) for a in args[1:])
            if mod.startswith(OURS) and (name in READS or names_device):
                counts[f"{mod}.{name}"] += 1
            return orig(*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        for name in READS + ("to",):
            stack.enter_context(mock.patch.object(torch.Tensor, name,
                                                  wrap(name, getattr(torch.Tensor, name))))
        stack.enter_context(mock.patch.object(torch, "tensor", wrap("tensor", torch.tensor)))
        yield counts


def _sync_ops(prof) -> dict:
    """Sync ops by their nearest Python frame outside torch (host-only sources left out)."""
    counts = collections.Counter()
    for ev in prof.events():
        if ev.name not in SYNC_OPS:
            continue
        chain, p = [], ev.cpu_parent
        while p is not None:
            if _FRAME.match(p.name):
                chain.append(p.name)
            p = p.cpu_parent
        if any(h in f for f in chain for h in HOST_ONLY):
            continue
        ours = [f for f in chain if not f.startswith(("torch/", "contextlib", "functools"))
                and "cpu_compat" not in f and "test_host_syncs" not in f]
        counts[f"{ev.name} {ours[0] if ours else '?'}"] += 1
    return dict(counts)


def _one_step(layers: int) -> dict:
    import numpy as np
    import torch

    import gpu_common as gc_

    argv = gc_.launcher_argv("tiny", ["--device", "cpu", "--num-layers", str(layers), "--bf16",
                                      "--recompute-granularity", "selective"],
                             seq_length=256, bucket=256)
    cfg, trainer, _ = gc_.start_run(argv)
    try:
        lengths = trainer.source.lengths
        ids = np.argsort(lengths, kind="stable")[-3:]  # three micro-batches of the bucket
        plan = gc_.plan_for(lengths[ids], trainer.batch_scheduler.cost_model,
                            cfg.skrull.bucket_size)
        trainer.run_plan(ids, plan)  # warm-up: what is built once per run
        with device_calls() as calls, torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
            trainer.run_plan(ids, plan)
        return {"micro_batches": plan.num_micro_batches, "calls": dict(calls),
                "syncs": _sync_ops(prof)}
    finally:
        trainer = None
        gc_.stop_run()


def _worker(rank, world, tmp):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    out = {layers: _one_step(layers) for layers in (2, 4)}
    with open(os.path.join(tmp, "counts.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_syncs")
    spawn(_worker, 1, tmp, timeout=300)
    with open(tmp / "counts.json") as f:
        return {int(k): v for k, v in json.load(f).items()}


@pytest.mark.multiprocess
def test_one_copy_per_micro_batch_and_one_read_per_step(counts):
    for layers, got in counts.items():
        m = got["micro_batches"]
        assert m == 3, got
        assert got["calls"] == {
            # inputs + attention metadata + RoPE positions of a micro-batch, one copy
            "skrull_ext.attention.staging.to": m,
            # RopeFrequencies.angles moves its frequencies to the positions' device once per
            # micro-batch: model.py hands them over already there (a no-op on CUDA)
            "megatron.skrull.rope.to": m,
            # the iteration's loss, once
            "megatron.skrull.training.__float__": 1,
        }, f"{layers} layers: {got['calls']}"


@pytest.mark.multiprocess
def test_syncs_do_not_grow_with_layers(counts):
    assert counts[2]["syncs"] == counts[4]["syncs"], (counts[2]["syncs"], counts[4]["syncs"])
    # what is left is per iteration (loss, token count, grad norm) or host-side in mcore's
    # cross entropy (a bool mask fill with a CPU scalar), never per layer
    assert sum(counts[4]["syncs"].values()) <= 4 + 2 * counts[4]["micro_batches"], counts[4]
