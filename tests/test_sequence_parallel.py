"""Megatron sequence parallelism (``--sequence-parallel``) with DACP attention.

Under SP the packed stream is split over the TP ranks between the layers' TP regions; the
core attention sees the gathered stream (padded to a multiple of TP). Checked in fp64:
TP 2 with SP, and TP 2 x CP 2 with SP under the skrull scheduler (the ring runs), give the
one-process losses and weights after a few iterations; TP 2 x PP 2 with SP those of TP 2 x
PP 2 without it. Two spawns: one process (the reference) and four processes (TP 2 x DP 2,
TP 2 x CP 2, TP 2 x PP 2 twice; parallel state re-initialised per case).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mcore_helpers import single_and_world, tiny_config

pytestmark = pytest.mark.multiprocess

CPU = torch.device("cpu")
ITERS = 3
# Odd global batch and seq length: stream lengths are odd, so SP must pad them.
# No clipping: mcore's grad norm sums squares in a float32 accumulator, and a clip
# coefficient off by 1e-8 moves Adam's update of near-zero gradients by ~1e-10.
BASE = ["--fp64", "--lr-decay-style", "constant", "--train-iters", str(ITERS),
        "--clip-grad", "0", "--seq-length", "95", "--global-batch-size", "5"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# Bucket 48: skrull shards the long samples over CP (the ring runs) and keeps short ones local.
RING = ["--context-parallel-size", "2", "--skrull-bucket-size", "48"]


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole-model parameters: TP shards all-gathered and put back in mcore's order.

    mcore's CPU initialisation splits a master weight into ``stride x TP`` chunks along
    ``partition_dim`` and gives rank ``r`` the chunks ``r, r + TP, ...``; this undoes it.
    """
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        data = param.detach()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data.contiguous(), group=group)
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            chunks = [s.chunk(stride, dim=dim) for s in shards]
            data = torch.cat([chunks[r][j] for j in range(stride) for r in range(tp)], dim=dim)
        out[name] = data.clone()
    return out


def _run(flags, world):
    from megatron.core import parallel_state
    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel
    from megatron.skrull.training import train

    cfg = tiny_config([*BASE, *flags], world_size=world)
    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg, CPU)
    trainer = build_trainer(cfg, CPU)
    stats = train(trainer, train_iters=ITERS)
    sp_norms = sorted(n for n, p in trainer.model.module.named_parameters()
                      if getattr(p, "sequence_parallel", False))
    return {"losses": [s.loss for s in stats], "grad_norms": [s.grad_norm for s in stats],
            "params": _full_params(trainer.model.module), "sp_norms": sp_norms,
            "sequence_parallel": trainer.model.module.config.sequence_parallel,
            "local_share": [s.local_share for s in stats]}


def _single(rank, world, tmp):
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    # TP 1 pads the vocabulary to 128 like TP 2 with 64 (per rank) does.
    # (The loss does not depend on the schedule: one reference for both layouts.)
    out = _run(["--make-vocab-size-divisible-by", "128"], 1)
    torch.save(out, os.path.join(tmp, "single.pt"))


def _worker(rank, world, tmp):
    from megatron.skrull import training
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    padded, pad = [], training.pad_micro_batch

    def counting_pad(inputs, multiple):  # records the streams SP had to pad
        out = pad(inputs, multiple)
        if out is not inputs:
            padded.append(out.input_ids.shape[1] - inputs.input_ids.shape[1])
        return out

    training.pad_micro_batch = counting_pad
    vocab = ["--make-vocab-size-divisible-by", "64"]
    out = {"tp": _run([*SP, *vocab], world),  # TP 2 x DP 2
           "cp": _run([*SP, *vocab, *RING, "--skrull-scheduler", "skrull"], world)}
    # TP 2 x PP 2 with and without SP ([T/TP, 1, h] activations between stages with it).
    pp = [*vocab, "--pipeline-model-parallel-size", "2"]
    out["pp"] = _run([*SP, *pp], world)
    out["pp_no_sp"] = _run(["--tensor-model-parallel-size", "2", *pp], world)
    out["padded"] = padded
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return single_and_world(tmp_path_factory, _single, _worker)


@pytest.mark.parametrize("case", ["tp", "cp"])
def test_sequence_parallel_matches_single_process(results, case):
    single, ranks = results
    ref = single
    for rank, r in enumerate(ranks):
        got = r[case]
        assert got["sequence_parallel"] and not ref["sequence_parallel"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-9, atol=0)
        # mcore's clip_grads sums the squared norms in a float32 accumulator.
        torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-6, atol=0)
        assert got["params"].keys() == ref["params"].keys()
        for name, value in got["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-9, atol=1e-12,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    # Every norm's weight is marked, so finalize_model_grads sums its gradient over TP.
    norms = ranks[0][case]["sp_norms"]
    assert len(norms) == 2 * 2 + 1 and all("layernorm" in n for n in norms), norms
    assert ranks[0][case]["losses"][-1] < ranks[0][case]["losses"][0]


def test_sequence_parallel_ring_and_local_attention_both_ran(results):
    _, ranks = results
    pads = [r["padded"] for r in ranks]  # odd streams got one padding row (TP group 0)
    assert pads[0] and pads[1] and all(set(p) <= {1} for p in pads), pads
    # Some iteration kept samples local and sharded others (ring and local attention).
    assert any(0.0 < share < 1.0 for share in ranks[0]["cp"]["local_share"]), \
        ranks[0]["cp"]["local_share"]


def test_padding_rows_are_appended_and_masked():
    from megatron.skrull.micro_batch import MicroBatchInputs, pad_micro_batch

    ids = torch.arange(1, 6)[None]
    inputs = MicroBatchInputs(input_ids=ids, position_ids=ids - 1, labels=ids + 1,
                              loss_mask=torch.ones(1, 5), packed_seq_params=None)
    padded = pad_micro_batch(inputs, 4)
    assert padded.input_ids.shape == (1, 8)
    assert padded.loss_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert padded.labels[0, :5].tolist() == (ids + 1)[0].tolist()
    assert pad_micro_batch(inputs, 5) is inputs and pad_micro_batch(None, 2) is None


def test_sequence_parallel_with_pipeline_matches_tensor_parallel(results):
    # Compared with TP 2 x PP 2 without SP: with PP each stage initialises its layers at
    # another point of the RNG stream than one process does (test_pipeline_training.py
    # loads the reference weights for that), so the one-process run is not the reference.
    _, ranks = results
    for rank, r in enumerate(ranks):
        got, ref = r["pp"], r["pp_no_sp"]
        assert got["sequence_parallel"] and not ref["sequence_parallel"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-9, atol=0)
        for name, value in got["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-9, atol=1e-12,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
