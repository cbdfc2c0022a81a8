"""Ranks sharing one GPU over gloo (``SKRULL_DIST_BACKEND=gloo``): the backend choice, its
errors, the kernel/precision check of the launcher on CUDA, and the mcore shim that lets DDP
reduce CUDA gradients over gloo (drift checks against upstream: no CUDA needed)."""
import inspect

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from megatron.skrull import cpu_compat
from megatron.skrull.pretrain_gpt import DIST_BACKEND_ENV, _attention_kernel, dist_backend
from skrull_ext.attention import aten, choice

from mcore_helpers import tiny_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_backend_choice_and_its_errors(monkeypatch):
    monkeypatch.delenv(DIST_BACKEND_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert dist_backend(CPU) == "gloo"
    monkeypatch.setenv(DIST_BACKEND_ENV, "nccl")
    with pytest.raises(ValueError, match="SKRULL_DIST_BACKEND=nccl: use gloo"):
        dist_backend(CPU)
    monkeypatch.setenv(DIST_BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="SKRULL_DIST_BACKEND=mpi"):
        dist_backend(CUDA)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(DIST_BACKEND_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks, one GPU
    with pytest.raises(ValueError, match="2 processes per node but 1 GPU.*SKRULL_DIST_BACKEND=gloo"):
        dist_backend(CUDA)
    monkeypatch.setenv(DIST_BACKEND_ENV, "GLOO")
    assert dist_backend(CUDA, tiny_config()) == "gloo"
    with pytest.raises(ValueError, match="drop --overlap-grad-reduce"):
        dist_backend(CUDA, tiny_config(["--overlap-grad-reduce"]))


def test_cuda_kernels_need_half_precision(monkeypatch):
    """On CUDA the flash/torch kernels take fp16/bf16 only: an fp32 run stops at
    startup naming the fix; the reference kernel runs in any precision."""
    monkeypatch.setattr(choice, "_CACHE", {})
    monkeypatch.setattr(choice, "te_available", lambda: False)
    monkeypatch.setattr(choice, "flash_attn_available", lambda: False)
    monkeypatch.setattr(aten, "flash_op_problem", lambda device: None)
    with pytest.raises(ValueError, match="auto runs the torch kernel, fp16/bf16 only on CUDA: "
                                         "add --bf16"):
        _attention_kernel(tiny_config(), CUDA)
    assert _attention_kernel(tiny_config(["--bf16"]), CUDA) == "torch"
    assert _attention_kernel(tiny_config(["--skrull-attention-kernel", "reference"]),
                             CUDA) == "reference"


def test_coalescing_shim_matches_upstream():
    """Upstream still reduces DDP buckets in torch's coalescing manager (imported by name),
    which hands captured all-reduces to ``allreduce_coalesced`` (CPU-only in gloo): the
    reason for the shim.  The shim takes the same arguments and runs nothing itself."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    upstream = cpu_compat.original("param_and_grad_buffer._coalescing_manager") or \
        buffers._coalescing_manager
    assert upstream is c10d._coalescing_manager
    assert "allreduce_coalesced" in inspect.getsource(c10d._coalescing_manager)
    src = inspect.getsource(buffers._ParamAndGradBucketGroup.start_grad_sync)
    assert "_coalescing_manager(communication_group, async_ops=async_op)" in src
    assert list(inspect.signature(cpu_compat._one_by_one_coalescing).parameters) == \
        list(inspect.signature(upstream).parameters)
    with cpu_compat._one_by_one_coalescing(None, async_ops=False) as cm:
        pass
    assert cm.wait() is None
    with pytest.raises(RuntimeError, match="drop --overlap-grad-reduce"):
        with cpu_compat._one_by_one_coalescing(None, async_ops=True):
            pass


def _shim_worker(rank, world, tmp):
    """One CP=2 training step (fp64) with mcore's coalescing manager, then with the shim:
    the shim is what DDP's gradient reduction goes through, and nothing changes."""
    import os

    from megatron.core.distributed import param_and_grad_buffer as buffers
    from test_skrull_training import CP2, _setup

    cpu_compat.apply_cpu_compat("cpu")
    cfg = tiny_config(["--fp64", "--context-parallel-size", "2"], world_size=2)

    def step():
        trainer = _setup(cfg, batch_scheduler=CP2)
        ids, plan = trainer.next_plan()
        return trainer.compute_gradients(ids, plan), trainer.gradients()

    before = step()
    assert cpu_compat.apply_gloo_cuda_compat() == ("param_and_grad_buffer._coalescing_manager",)
    calls, shim = [], buffers._coalescing_manager
    assert shim is cpu_compat._one_by_one_coalescing
    buffers._coalescing_manager = lambda *a, **k: calls.append(k) or shim(*a, **k)
    after = step()
    torch.save({"before": before, "after": after, "calls": calls},
               os.path.join(tmp, f"out{rank}.pt"))


@pytest.mark.multiprocess
def test_ddp_reduces_through_the_shim_unchanged(tmp_path):
    from mcore_helpers import spawn

    spawn(_shim_worker, 2, tmp_path, timeout=240)
    for rank in range(2):
        out = torch.load(tmp_path / f"out{rank}.pt", weights_only=False)
        assert out["calls"] and all(not c.get("async_ops") for c in out["calls"])
        assert out["before"][0] == out["after"][0]
        for name, g in out["before"][1].items():
            torch.testing.assert_close(out["after"][1][name], g, rtol=0, atol=0)
