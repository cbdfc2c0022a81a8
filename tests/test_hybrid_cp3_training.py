"""The default scheduler at CP = 3 picks hybrid CP's plan (a 2-rank CP sub-group of 3
ranks) and trains it exactly like all-CP: 3 gloo ranks, one spawn, float64.

Seed 4's first global batch (``--seq-length 48``) is ``[8, 27, 9, 17, 20, 9]``; with a
16-token bucket the 17-, 20- and 27-token samples fit two ranks (at most 14 tokens each
after zigzag padding) but not one, so Skrull's last candidate, hybrid CP's own plan,
shards each over the sub-group ``{0, 1}`` and keeps a short sample whole on rank 2, and
is predicted faster than Skrull's all-rank rings (``predicted["candidate"] ==
"hybrid-cp"``).
"""
from __future__ import annotations

import os

import pytest
import torch

from mcore_helpers import spawn, tiny_config

pytestmark = pytest.mark.multiprocess

FLAGS = ["--fp64", "--context-parallel-size", "3", "--skrull-bucket-size", "16",
         "--seq-length", "48", "--seed", "4"]


def _one_step(policy):
    from megatron.core import parallel_state
    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel

    cfg = tiny_config([*FLAGS, "--skrull-scheduler", policy], world_size=3)
    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg, torch.device("cpu"))
    trainer = build_trainer(cfg, torch.device("cpu"))
    ids, plan = trainer.next_plan()
    loss = trainer.compute_gradients(ids, plan)
    groups = sorted({g[1:] for mbs in plan.dp_ranks for mb in mbs for g in mb.grouped})
    return {"ids": ids, "loss": loss, "grads": trainer.gradients(), "subgroups": groups,
            "candidate": plan.predicted.get("candidate")}


def _worker(rank, world, tmp):
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    out = {policy: _one_step(policy) for policy in ("skrull", "all-cp")}
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_cp3_training")
    spawn(_worker, 3, tmp, timeout=240)
    return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False) for r in range(3)]


def test_skrull_keeps_hybrid_cp_plan_with_a_sub_group_at_cp3(results):
    got = results[0]["skrull"]
    assert got["candidate"] == "hybrid-cp"
    assert got["subgroups"] and all(n == 2 for _, n in got["subgroups"]), got["subgroups"]
    assert results[0]["all-cp"]["subgroups"] == []


def test_cp3_sub_group_ring_loss_and_gradients_equal_all_cp(results):
    for rank in range(3):
        got, ref = results[rank]["skrull"], results[rank]["all-cp"]
        assert torch.equal(torch.as_tensor(got["ids"]), torch.as_tensor(ref["ids"]))
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-12, atol=0)
        assert got["grads"].keys() == ref["grads"].keys()
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-10, atol=1e-13,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
