"""The GPU adapters (flash-attn 2.6-2.8, Transformer Engine) driven through fakes of the
libraries (tests/fakes), single process; the world-2/4 parity, stream-order and host-sync
checks through the same fakes run in tests/test_attention_dist.py."""
import inspect
import logging
import math

import pytest
import torch

import fakes
from fakes import flash_attn as fake_flash
from skrull_ext.attention import ReferenceKernel, dacp_attention, get_kernel
from skrull_ext.attention.layout import build_rank_layout

from _attn_worker import reference_attention, single_rank_parity

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("version", fakes.FLASH_VERSIONS)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_adapter_matches_reference_for_every_api_shape(monkeypatch, version, causal):
    fakes.install(monkeypatch, "flash", version)
    kernel = get_kernel("flash", CPU, torch.float64)
    assert kernel.name == "flash" and kernel.version == version
    cu_q = (0, 5, 6, 13)
    cu_k = cu_q if causal else (0, 3, 9, 11)
    q, k, v = rand(13, 4, 8, seed=1), rand(cu_k[-1], 2, 8, seed=2), rand(cu_k[-1], 2, 8, seed=3)
    dout = rand(13, 4, 8, seed=4)
    ref = ReferenceKernel()
    out, lse = kernel.forward(q, k, v, cu_q, cu_k, causal=causal, scale=0.4)
    want_out, want_lse = ref.forward(q, k, v, cu_q, cu_k, causal=causal, scale=0.4)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    got = kernel.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=0.4)
    want = ref.backward(dout, q, k, v, want_out, want_lse, cu_q, cu_k, causal=causal, scale=0.4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_flash_adapter_reads_custom_op_parameters(monkeypatch):
    mods = fakes.install(monkeypatch, "flash", "2.8.3")
    fwd = mods["flash_attn.flash_attn_interface"]._flash_attn_varlen_forward
    assert not hasattr(fwd, "__wrapped__")  # what inspect sees is (*args, **kwargs):
    assert list(inspect.signature(fwd).parameters) == ["args", "kwargs"]
    kernel = get_kernel("flash", CPU, torch.float64)
    assert {"window_size_left", "window_size_right", "zero_tensors"} <= kernel._fwd_params
    assert "window_size" not in kernel._fwd_params and "window_size" not in kernel._bwd_params
    fakes.install(monkeypatch, "flash", "2.6.3")
    kernel = get_kernel("flash", CPU, torch.float64)
    assert "window_size" in kernel._bwd_params and "zero_tensors" not in kernel._bwd_params


def test_flash_before_2_6_is_rejected_and_padded_lse_caught(monkeypatch):
    fakes.install(monkeypatch, "flash", "2.5.9")
    with pytest.raises(RuntimeError, match="2.5.9 pads the varlen softmax LSE.*flash-attn>=2.6"):
        get_kernel("flash", CPU, torch.float64)
    mods = fakes.install(monkeypatch, "flash", "2.6.3")  # a build whose forward pads anyway
    monkeypatch.setattr(mods["flash_attn.flash_attn_interface"], "_flash_attn_varlen_forward",
                        fake_flash._fwd_25)
    kernel = get_kernel("flash", CPU, torch.float64)
    q = rand(4, 2, 8)
    with pytest.raises(RuntimeError, match=r"padded varlen LSE \(1, 2, 4\)"):
        kernel.forward(q, q, q, (0, 4), (0, 4), causal=False, scale=1.0)


def test_flash_unknown_required_parameter_is_a_clear_error(monkeypatch):
    mods = fakes.install(monkeypatch, "flash", "2.8.3")

    def future(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, new_required_thing):
        raise AssertionError("never called")

    monkeypatch.setattr(mods["flash_attn.flash_attn_interface"], "_flash_attn_varlen_forward",
                        fake_flash.CustomOp("x", future))
    with pytest.raises(RuntimeError, match="requires \\['new_required_thing'\\]"):
        get_kernel("flash", CPU, torch.float64)


def test_auto_on_cuda_prefers_te_then_flash_and_logs_once(monkeypatch, caplog):
    fakes.install(monkeypatch, "flash", "2.8.3")
    caplog.set_level(logging.INFO, logger="skrull_ext.attention")
    assert get_kernel("auto", CUDA, torch.bfloat16).name == "flash"
    assert get_kernel("auto", CUDA, torch.bfloat16).name == "flash"
    assert [r.getMessage() for r in caplog.records] == ["attention kernel auto -> flash on cuda"]
    fakes.install(monkeypatch, "te", "2.9")
    assert get_kernel("auto", CUDA, torch.bfloat16).name == "te"
    assert get_kernel("auto", CPU, torch.float32).name == "torch"


def _single_rank(backend, monkeypatch, kind, version, log=None):
    fakes.install(monkeypatch, kind, version, log)
    single_rank_parity(backend)


@pytest.mark.parametrize("version", fakes.FLASH_VERSIONS)
def test_dacp_attention_without_group_through_fake_flash(monkeypatch, version):
    _single_rank("flash", monkeypatch, "flash", version)


@pytest.mark.parametrize("version", ["1.13", "2.9"])
def test_dacp_attention_without_group_through_fake_te(monkeypatch, version):
    log = []
    _single_rank("te", monkeypatch, "te", version, log)
    assert [e for e in log if e[0] == "te_forward"] == [("te_forward", "local", "none")]
    assert not any(e[0] == "te_set_cp_group" for e in log)  # no CP group: no ring


def test_te_kernel_refuses_a_custom_comm(monkeypatch):
    fakes.install(monkeypatch, "te", "2.9")
    lay = build_rank_layout([3], [], [[0]], 0, 1)
    q = rand(3, 2, 4)
    with pytest.raises(ValueError, match="drop comm="):
        dacp_attention(q, q, q, lay, None, backend="te", comm=object())


def test_te_kernel_sub_group_rings_need_flash_attn(monkeypatch):
    """A grouped placement next to TE runs our ring with flash-attn's kernel; without
    flash-attn one clear error names the fix (a one-rank sub-group: no CP group needed)."""
    fakes.install(monkeypatch, "te", "2.9")
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", None)  # not importable
    lay = build_rank_layout([3, 5], [], [[0]], 0, 1, grouped=[(1, 0, 1)])
    q = rand(8, 2, 4)
    with pytest.raises(RuntimeError, match="sub-group placements.*install flash-attn"):
        dacp_attention(q, q, q, lay, None, backend="te")
    fakes.install(monkeypatch, "flash", "2.8.3")
    q, k, v = (rand(8, 2, 4, seed=s).requires_grad_() for s in (1, 2, 3))
    out = dacp_attention(q, k, v, lay, None, backend="te")
    out.sum().backward()
    for s, (a, b) in ((0, (0, 3)), (1, (3, 8))):  # both samples attended whole, causally
        qs, ks, vs = (t.detach()[a:b].clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qs, ks, vs, 1 / math.sqrt(4))
        torch.testing.assert_close(out[a:b], ref)
        grads = torch.autograd.grad(ref.sum(), (qs, ks, vs))
        for got, want in zip((q.grad[a:b], k.grad[a:b], v.grad[a:b]), grads):
            torch.testing.assert_close(got, want)


def test_fakes_do_not_leak():
    import sys

    for name in ("flash_attn", "transformer_engine"):  # fakes have an empty __path__
        assert getattr(sys.modules.get(name), "__path__", None) != [], name
    from skrull_ext.attention import choice
    assert all(k.name in ("torch", "reference") for k in choice._CACHE.values())


def test_launcher_flag_env_and_errors(monkeypatch):
    from megatron.skrull.arguments import ConfigError, parse_args

    argv = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "16", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters",
            "1", "--skrull-bucket-size", "16"]
    monkeypatch.delenv("SKRULL_ATTENTION_KERNEL", raising=False)
    assert parse_args(argv).skrull.attention_kernel == "auto"
    assert parse_args(argv + ["--skrull-attention-kernel", "te"]).skrull.attention_kernel == "te"
    monkeypatch.setenv("SKRULL_ATTENTION_KERNEL", "reference")
    assert parse_args(argv).skrull.attention_kernel == "reference"
    assert parse_args(argv + ["--skrull-attention-kernel", "flash"]).skrull.attention_kernel == "flash"
    monkeypatch.setenv("SKRULL_ATTENTION_KERNEL", "fastest")
    with pytest.raises(ConfigError, match="'fastest'.*SKRULL_ATTENTION_KERNEL.*auto, flash, te"):
        parse_args(argv)


def test_launcher_missing_kernel_library_is_one_error_line(tmp_path):
    """The launcher resolves the kernel before building the model: asking for flash-attn
    where it is not installed stops with one error line naming the install, exit 2."""
    import os
    import subprocess
    import sys

    from mcore_helpers import TINY_FLAGS
    from skrull_ext.attention import flash_attn_available

    if flash_attn_available():
        pytest.skip("flash-attn is installed here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY_FLAGS,
                           "--train-iters", "1", "--skrull-attention-kernel", "flash"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--skrull-attention-kernel flash" in errors[0] \
        and "pip install 'flash-attn>=2.6,<2.9'" in errors[0], proc.stderr[-2000:]
