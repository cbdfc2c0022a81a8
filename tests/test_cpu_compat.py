"""The CPU shims of megatron/skrull/cpu_compat.py, and the upstream code they patch.

These tests FAIL when megatron-core changes under the shims: a patched function or class
disappears or changes signature, the upstream code stops assuming CUDA (drop the shim), or
an mcore extension point our model relies on (``GPTModel`` without RoPE, the ``thd``
``PackedSeqParams`` path of SelfAttention and its ``core_attention`` call, the public
``apply_rotary_pos_emb``) changes shape.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megatron.core.fusions import fused_softmax
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import attention as mcore_attention
from megatron.core.transformer import utils as tr_utils
from megatron.skrull import cpu_compat

NO_CUDA = not torch.cuda.is_available()


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_patched_upstream_objects_keep_their_signatures():
    assert _params(tr_utils.get_default_causal_mask) == ["sq"]
    assert _params(tr_utils.get_sliding_window_causal_mask) == ["sq", "skv", "window_size"]
    assert _params(cpu_compat.ORIGINALS.get("random._get_cuda_rng_state",
                                            tp_random._get_cuda_rng_state)) == \
        ["device", "clone", "graph_safe"]
    assert _params(cpu_compat.ORIGINALS.get("random._set_cuda_rng_state",
                                            tp_random._set_cuda_rng_state)) == \
        ["new_state", "device", "graph_safe"]
    tracker = cpu_compat.ORIGINALS.get("random.CudaRNGStatesTracker",
                                       tp_random.CudaRNGStatesTracker)
    assert _params(tracker.add) == ["self", "name", "seed"]
    assert _params(tracker.fork) == ["self", "name"]
    for attr in ("reset", "get_states", "set_states", "states_", "seeds_", "_current_state_name"):
        assert hasattr(tracker(), attr), attr
    assert "force_reset" in _params(tp_random.initialize_rng_tracker)
    assert hasattr(tp_random, "_CUDA_RNG_STATE_TRACKER")
    # fused_softmax binds the mask functions by name: both bindings must exist.
    assert hasattr(fused_softmax, "get_default_causal_mask")
    assert hasattr(fused_softmax, "get_sliding_window_causal_mask")


def test_model_relies_on_these_mcore_paths():
    # build_model: GPTModel(position_embedding_type="none") builds no RoPE of its own (only
    # 'rope'/'yarn'/'mrope' do), so mcore never computes or applies a rotary table.
    init = inspect.getsource(GPTModel.__init__)
    assert "self.position_embedding_type == 'rope'" in init
    assert "position_embedding_type" in _params(GPTModel.__init__)
    # SkrullPackedSeqParams extends these fields (thd: batch dim squeezed by mcore).
    fields = {f.name for f in dataclasses.fields(PackedSeqParams)}
    assert {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv",
            "cp_group"} <= fields
    fwd = inspect.getsource(mcore_attention.Attention.forward)
    # thd: q/k/v reach core_attention as [T, heads, dim] with the packed_seq_params object
    # unchanged, and the output is reshaped back to [T, 1, hidden].
    assert "packed_seq_params.qkv_format == 'thd'" in fwd
    assert "query = query.squeeze(1)" in fwd
    assert "packed_seq_params=packed_seq_params" in fwd
    assert "core_attn_out.reshape(core_attn_out.size(0), 1, -1)" in fwd
    # SkrullCoreAttention applies RoPE with this public function (per-token bshd path) and
    # builds its frequencies like RotaryEmbedding.get_emb.
    assert _params(rope_utils.apply_rotary_pos_emb) == ["t", "freqs", "config", "cu_seqlens",
                                                        "mscale", "cp_group"]
    assert _params(rotary_pos_embedding.RotaryEmbedding.get_emb) == ["self", "max_seq_len",
                                                                     "offset"]
    t, f = torch.randn(5, 1, 2, 8), torch.randn(5, 1, 1, 8)
    out = rope_utils._apply_rotary_pos_emb_bshd(t, f)
    assert out.shape == t.shape


@pytest.mark.skipif(not NO_CUDA, reason="upstream behaviour is only observable without CUDA")
def test_upstream_still_assumes_cuda():
    cpu_compat.apply_cpu_compat("cpu")
    originals = cpu_compat.ORIGINALS
    with pytest.raises((AssertionError, RuntimeError)):
        originals["torch.cuda.current_device"]()
    with pytest.raises((AssertionError, RuntimeError)):
        originals["transformer.utils.get_default_causal_mask"](4)
    with pytest.raises((AssertionError, RuntimeError)):
        originals["random.CudaRNGStatesTracker"]().add("x", 1)
    # RoPE's CP slicing (bypassed by our model, not patched) still pins + moves to CUDA.
    assert ".cuda(" in inspect.getsource(rope_utils.get_pos_emb_on_this_cp_rank)
    assert "torch.cuda.current_device()" in inspect.getsource(
        rotary_pos_embedding.RotaryEmbedding.get_emb)


def test_patched_behaviour_on_cpu():
    patched = cpu_compat.apply_cpu_compat("cpu")
    assert "torch.cuda.current_device" in patched
    assert cpu_compat.apply_cpu_compat("cpu") == patched  # idempotent
    assert cpu_compat.cpu_compat_applied()
    assert torch.cuda.current_device() == torch.device("cpu")
    mask = tr_utils.get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert fused_softmax.get_default_causal_mask is tr_utils.get_default_causal_mask
    window = tr_utils.get_sliding_window_causal_mask(3, 3, (1, 0))
    assert window.tolist() == [[False, True, True], [False, False, True], [True, False, False]]


def test_rng_tracker_forks_cpu_streams():
    cpu_compat.apply_cpu_compat("cpu")
    tp_random.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0,
                                              force_reset_rng=True)
    tracker = tp_random.get_cuda_rng_tracker()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    # The fork advanced its own stream, not the default one.
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(a, b)
    gen = torch.Generator().manual_seed(123 + 2718)
    expected = torch.rand(8, generator=gen)
    torch.testing.assert_close(torch.cat([a, b]), expected)
    # TP rank 1 gets a different stream.
    tp_random.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0,
                                              force_reset_rng=True)
    with tp_random.get_cuda_rng_tracker().fork():
        c = torch.rand(4)
    assert not torch.equal(a, c)
    states = tp_random.get_cuda_rng_tracker().get_states()
    assert set(states) >= {"model-parallel-rng", "data-parallel-rng"}


def test_noop_when_training_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply_cpu_compat("cuda") == ()
    assert cpu_compat.resolve_device("auto").type == "cuda"


def test_cuda_requested_without_cuda_is_a_clear_error():
    if not NO_CUDA:
        pytest.skip("machine has CUDA")
    with pytest.raises(ValueError, match="--device cpu"):
        cpu_compat.resolve_device("cuda")


@pytest.mark.skipif(not NO_CUDA, reason="upstream behaviour is only observable without CUDA")
def test_mcore_ddp_optimizer_schedule_still_assume_cuda():
    # What cuda_to_cpu exists for; when upstream drops these, drop the mode.
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.pipeline_parallel import schedules

    assert 'device="cuda"' in inspect.getsource(schedules.forward_backward_no_pipelining)
    assert "device='cuda'" in inspect.getsource(optimizer.FP32Optimizer)
    assert "device='cuda'" in inspect.getsource(clip_grads.get_grad_norm_fp32)
    assert "param.grad.type() == 'torch.cuda.FloatTensor'" in inspect.getsource(
        clip_grads.clip_grad_by_total_norm_fp32)
    assert "model_param.type() == 'torch.cuda.FloatTensor'" in inspect.getsource(
        distrib_optimizer.DistributedOptimizer)
    assert "torch.cuda.current_device()" in inspect.getsource(param_and_grad_buffer)
    assert "shard_main_param.grad = shard_model_grad.float()" in inspect.getsource(
        distrib_optimizer.DistributedOptimizer)
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_cuda_to_cpu_mode_is_scoped():
    cpu_compat.keep_float64(True)  # what a --fp64 run sets (build_trainer)
    t64 = torch.zeros(2, dtype=torch.float64)
    with cpu_compat.cuda_to_cpu("cpu"):
        assert torch.zeros(3, dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert t64.cuda() is t64
        # float64 plays float32's role (full-precision params are their own main params).
        assert t64.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"
        assert t64.type(torch.float32).dtype == torch.float32  # conversions untouched
        assert t64.float() is t64 and torch.zeros(1, dtype=torch.float16).float().dtype == \
            torch.float32
    assert t64.type() == "torch.DoubleTensor"  # gone after the block
    if NO_CUDA:
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(1, device="cuda")


def test_float64_kept_only_in_fp64_parity_mode():
    # mcore's fp16 loss scaler computes its inverse scale in double and casts it back with
    # .float(); the float64-keeping .float() must not touch that outside --fp64 runs.
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    t64 = torch.zeros(2, dtype=torch.float64)
    try:
        cpu_compat.keep_float64(False)
        with cpu_compat.cuda_to_cpu("cpu"):
            scaler = DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0,
                                       backoff_factor=0.5, growth_interval=1000, hysteresis=2)
            assert scaler.inv_scale.dtype == torch.float32
            assert t64.float().dtype == torch.float32
    finally:
        cpu_compat.keep_float64(True)
    with cpu_compat.cuda_to_cpu("cpu"):
        assert t64.float() is t64


def test_checkpoint_writer_shim_matches_upstream_and_is_scoped():
    # cpu_checkpoint_io stands in for these upstream pieces; fail when they move.
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    writer = fsa.FileSystemWriterAsync
    assert _params(writer.write_preloaded_data_multiproc) == \
        ["transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"]
    assert _params(writer.write_preloaded_data)[:6] == \
        ["transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue",
         "use_fsync"]
    assert "torch.cuda.synchronize()" in inspect.getsource(writer.preload_tensors)
    assert "Manager()" in inspect.getsource(fsa._get_write_results_queue)
    assert 'get_context("fork")' in inspect.getsource(writer.write_preloaded_data_multiproc)
    before = (torch.cuda.synchronize, fsa._get_write_results_queue,
              writer.__dict__["write_preloaded_data_multiproc"])
    with cpu_compat.cpu_checkpoint_io("cpu"):
        torch.cuda.synchronize()  # would raise on a CPU-only torch without the shim
        assert fsa._get_write_results_queue is not before[1]
    after = (torch.cuda.synchronize, fsa._get_write_results_queue,
             writer.__dict__["write_preloaded_data_multiproc"])
    assert after == before  # restored: the shim lives only inside the block


def test_checkpoint_io_roundtrip_on_cpu(tmp_path):
    # The in-process writer produces a checkpoint upstream's loader reads back.
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        (tmp_path / "c").mkdir()
        with cpu_compat.cpu_checkpoint_io("cpu"):
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", t), "n": 7},
                                    str(tmp_path / "c"))
            out = dist_checkpointing.load(
                {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4,
                                                                       dtype=torch.float64))},
                str(tmp_path / "c"))
        torch.testing.assert_close(out["w"], t, rtol=0, atol=0)
        assert out["n"] == 7
    finally:
        dist.destroy_process_group()


def test_foreach_multi_tensor_matches_upstream_fallbacks_bit_for_bit():
    """mcore without TE/apex binds its local multi-tensor fallbacks (the shim swaps exactly
    those, inside the block only); the foreach versions give the same bits on CPU: the grad
    norm in fp32 and fp64 (parity mode), in-place clipping, the fp32 -> bf16 param copy."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    bound = [(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm),
             (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale),
             (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)]
    for owner, name, local in bound:  # no TE/apex here: upstream's own fallbacks
        assert getattr(owner, name) is local, name
    assert _params(utils.local_multi_tensor_l2_norm)[:4] == [
        "chunk_size", "noop_flag", "tensor_lists", "per_tensor"]
    assert _params(utils.local_multi_tensor_scale) == [
        "chunk_size", "noop_flag", "tensor_lists", "scale"]
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        grads = [torch.randn(s, generator=gen, dtype=dtype) * 10 ** i
                 for i, s in enumerate([(7, 3), (5,), (64, 33), (1,)])]
        with cpu_compat.cuda_to_cpu("cpu"), cpu_compat.foreach_multi_tensor():
            for owner, name, local in bound:
                assert getattr(owner, name) is not local
            mine = clip_grads.l2_norm_impl(0, None, [grads], False)[0]
        with cpu_compat.cuda_to_cpu("cpu"):  # upstream puts its result on "cuda"
            theirs = utils.local_multi_tensor_l2_norm(0, None, [grads], False)[0]
        assert mine.dtype == theirs.dtype == torch.float32 and torch.equal(mine, theirs)
        a, b = [g.clone() for g in grads], [g.clone() for g in grads]
        cpu_compat._foreach_scale(0, None, [a, a], 0.37)
        utils.local_multi_tensor_scale(0, None, [b, b], 0.37)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        half_a = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
        half_b = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
        cpu_compat._foreach_scale(0, None, [grads, half_a], 1.0)
        utils.local_multi_tensor_scale(0, None, [grads, half_b], 1.0)
        assert all(torch.equal(x, y) for x, y in zip(half_a, half_b))
    for owner, name, local in bound:  # restored after the block
        assert getattr(owner, name) is local
