"""Training with hybrid-CP sub-group placements, one spawn per CP size (float64).

CP = 4 on 4 gloo ranks: ``--skrull-scheduler hybrid-cp`` with a 24-token bucket shards the
first batch's samples of 29 and 31 tokens over 2-rank CP sub-groups
(``MicroBatch.grouped``), the 96-token one over all 4 ranks and keeps the rest (11-15
tokens) whole; the DACP attention runs one zigzag ring per sub-group after the full ring.
The same batch under ``all-cp`` (every sample over all 4 ranks) must give the same loss
and gradients, as must Megatron's dynamic-CP plan (``dynamic-cp``, also Skrull's last
candidate), and two training iterations run on every rank alike.

CP = 3 on 3 gloo ranks: the *default* scheduler picks hybrid CP's plan.  Seed 4's first
global batch (``--seq-length 48``) is ``[8, 27, 9, 17, 20, 9]``; with a 16-token bucket
the 17-, 20- and 27-token samples fit two ranks (at most 14 tokens each after zigzag
padding) but not one, so Skrull's last candidate, hybrid CP's own plan, shards each over
the sub-group ``{0, 1}``, keeps a short sample whole on rank 2, and is predicted faster
than Skrull's all-rank rings (``predicted["candidate"] == "hybrid-cp"``).
"""
from __future__ import annotations

import os

import pytest
import torch

from mcore_helpers import spawn, tiny_config

pytestmark = pytest.mark.multiprocess

# Seed 6: the first global batch has lengths [96, 31, 11, 29, 11, 15].
FLAGS = ["--fp64", "--context-parallel-size", "4", "--skrull-bucket-size", "24", "--seed", "6"]
CP3_FLAGS = ["--fp64", "--context-parallel-size", "3", "--skrull-bucket-size", "16",
             "--seq-length", "48", "--seed", "4"]


def _setup(cfg):
    from megatron.core import parallel_state
    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel

    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg, torch.device("cpu"))
    return build_trainer(cfg, torch.device("cpu"))


def _one_step(policy, flags=FLAGS, world=4):
    trainer = _setup(tiny_config([*flags, "--skrull-scheduler", policy], world_size=world))
    ids, plan = trainer.next_plan()
    loss = trainer.compute_gradients(ids, plan)
    kinds = {"grouped": 0, "distributed": 0, "local": 0}
    for mbs in plan.dp_ranks:
        for mb in mbs:
            kinds["grouped"] += len(mb.grouped)
            kinds["distributed"] += len(mb.distributed)
            kinds["local"] += sum(len(r) for r in mb.local)
    return {"ids": ids, "loss": loss, "grads": trainer.gradients(), "kinds": kinds,
            "subgroups": sorted({g[1:] for mbs in plan.dp_ranks for mb in mbs
                                 for g in mb.grouped}),
            "candidate": plan.predicted.get("candidate")}


def _worker(rank, world, tmp):
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from megatron.skrull.training import train

    apply_cpu_compat("cpu")
    out = {policy: _one_step(policy) for policy in ("hybrid-cp", "all-cp", "dynamic-cp")}
    cfg = tiny_config([*FLAGS, "--skrull-scheduler", "hybrid-cp", "--train-iters", "2"],
                      world_size=4)
    out["train"] = [s.loss for s in train(_setup(cfg), train_iters=2)]
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


def _worker_cp3(rank, world, tmp):
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    out = {policy: _one_step(policy, CP3_FLAGS, 3) for policy in ("skrull", "all-cp")}
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


def _spawned(tmp_path_factory, worker, world):
    tmp = tmp_path_factory.mktemp(f"hybrid_cp_training_{world}")
    spawn(worker, world, tmp, timeout=240)
    return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False)
            for r in range(world)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _spawned(tmp_path_factory, _worker, 4)


@pytest.fixture(scope="module")
def results_cp3(tmp_path_factory):
    return _spawned(tmp_path_factory, _worker_cp3, 3)


def _assert_same_step(results, policy):
    """Every rank: the same samples, loss and gradients as ``all-cp`` (float64)."""
    for rank, res in enumerate(results):
        got, ref = res[policy], res["all-cp"]
        assert torch.equal(torch.as_tensor(got["ids"]), torch.as_tensor(ref["ids"]))
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-12, atol=0)
        assert got["grads"].keys() == ref["grads"].keys()
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-10, atol=1e-13,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")


def test_hybrid_cp_plan_uses_sub_groups(results):
    kinds = results[0]["hybrid-cp"]["kinds"]
    assert kinds["grouped"] > 0 and kinds["local"] > 0 and kinds["distributed"] > 0, kinds
    assert all(n == 2 for _, n in results[0]["hybrid-cp"]["subgroups"])


def test_hybrid_cp_loss_and_gradients_equal_all_cp(results):
    _assert_same_step(results, "hybrid-cp")


def test_dynamic_cp_plan_trains_as_all_cp(results):
    """Megatron's dynamic-CP plan (also Skrull's candidate): its sub-group rings give the
    same loss and gradients as all-rank rings."""
    assert results[0]["dynamic-cp"]["kinds"]["grouped"] > 0
    _assert_same_step(results, "dynamic-cp")


def test_hybrid_cp_trains_alike_on_every_rank(results):
    losses = results[0]["train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert all(r["train"] == losses for r in results[1:])


def test_skrull_keeps_hybrid_cp_plan_with_a_sub_group_at_cp3(results_cp3):
    got = results_cp3[0]["skrull"]
    assert got["candidate"] == "hybrid-cp"
    assert got["subgroups"] and all(n == 2 for _, n in got["subgroups"]), got["subgroups"]
    assert results_cp3[0]["all-cp"]["subgroups"] == []


def test_cp3_sub_group_ring_loss_and_gradients_equal_all_cp(results_cp3):
    _assert_same_step(results_cp3, "skrull")
