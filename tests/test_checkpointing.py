"""Checkpoints through ``megatron.core.dist_checkpointing``: resume at another layout with
the uninterrupted run's fp64 losses, exact resume at the same layout, fallback from a corrupt
newest checkpoint, a killed save, and the bad inputs (missing ``--load``, another model).

Two spawns: 2 gloo ranks (DP 2) run the reference and save; then 1 rank (DP 1) resumes.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from mcore_helpers import spawn, tiny_config

pytestmark = pytest.mark.multiprocess

CPU = torch.device("cpu")
FLAGS = ["--fp64", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--train-iters",
         "4", "--skrull-bucket-size", "128"]


def _setup(cfg):
    from megatron.core import parallel_state
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel

    apply_cpu_compat(CPU)
    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg, CPU)
    return build_trainer(cfg, CPU)


def _train(trainer, iters, save_to=None, cfg=None):
    import dataclasses

    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.training import train

    meta = ckpt.CheckpointMeta.from_parallel_state()
    save_fn = None
    if save_to:
        desc = dataclasses.asdict(cfg) if cfg is not None else None
        save_fn = lambda t: ckpt.save_checkpoint(save_to, t, meta, desc)  # noqa: E731
    return [s.loss for s in train(trainer, train_iters=iters, save_interval=1,
                                  save_fn=save_fn)]


def _load(root, trainer, cfg, **opts):
    import dataclasses

    from megatron.skrull import checkpointing as ckpt

    return ckpt.load_checkpoint(root, trainer, ckpt.CheckpointMeta.from_parallel_state(),
                                dataclasses.asdict(cfg), **opts)


def _save_at_dp2(rank, world, tmp):
    """Reference run (4 iterations) and a run saving iterations 1 and 2, at DP 2; then the
    DP-2 checkpoint resumed at CP 2 (another layout, same world)."""
    cfg = tiny_config(FLAGS, world_size=2)
    full = _train(_setup(cfg), 4)
    _train(_setup(cfg), 2, save_to=f"{tmp}/ckpt", cfg=cfg)
    same = _setup(cfg)
    at_same = _load(f"{tmp}/ckpt", same, cfg)
    same_losses = _train(same, 4)
    cp_cfg = tiny_config(FLAGS + ["--context-parallel-size", "2"], world_size=2)
    cp = _setup(cp_cfg)
    at_cp = _load(f"{tmp}/ckpt", cp, cp_cfg)
    out = {"full": full, "same": same_losses, "at_same": at_same, "cp": _train(cp, 4),
           "at_cp": at_cp}
    with open(os.path.join(tmp, f"dp2_{rank}.json"), "w") as f:
        json.dump(out, f)


def _corrupt(path):
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "r+b") as f:
                f.truncate(16)


def _resume_at_dp1(rank, world, tmp):
    """DP 1 resumes the DP-2 checkpoint; fallback from a corrupt newest; bad inputs."""
    from megatron.skrull.checkpointing import CheckpointError, iteration_dir

    cfg = tiny_config(FLAGS, world_size=1)
    out = {}
    trainer = _setup(cfg)
    out["at_dp1"] = _load(f"{tmp}/ckpt", trainer, cfg)
    out["dp1"] = _train(trainer, 4)
    # The newest checkpoint unreadable, and a killed save of iteration 3 (no metadata.json,
    # tracker not updated): resume from iteration 1, then save 3 over the debris.
    broken = f"{tmp}/broken"
    shutil.copytree(f"{tmp}/ckpt", broken)
    _corrupt(iteration_dir(broken, 2))
    shutil.copytree(iteration_dir(broken, 2), iteration_dir(broken, 3))
    os.remove(os.path.join(iteration_dir(broken, 3), "metadata.json"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron.skrull.checkpointing").addHandler(handler)
    trainer = _setup(cfg)
    out["at_fallback"] = _load(broken, trainer, cfg)
    out["errors"] = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    out["fallback"] = _train(trainer, 4, save_to=broken, cfg=cfg)
    out["tracker"] = open(f"{broken}/latest_checkpointed_iteration.txt").read()
    # Bad inputs: a missing directory; a checkpoint of another model.
    for key, root, c in (("missing", f"{tmp}/no-such-dir", cfg),
                         ("other_model", f"{tmp}/ckpt",
                          tiny_config(FLAGS + ["--hidden-size", "32"], world_size=1))):
        try:
            _load(root, _setup(c), c)
            out[key] = None
        except CheckpointError as exc:
            out[key] = str(exc)
    # --finetune: weights only, iteration 0.
    out["finetune"] = _load(f"{tmp}/ckpt", _setup(cfg), cfg, finetune=True)
    with open(os.path.join(tmp, "dp1.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    spawn(_save_at_dp2, 2, tmp, timeout=300)
    spawn(_resume_at_dp1, 1, tmp, timeout=300)
    dp2 = [json.load(open(tmp / f"dp2_{r}.json")) for r in range(2)]
    return {"dp2": dp2, "dp1": json.load(open(tmp / "dp1.json")), "tmp": tmp}


def test_layout_on_disk_is_megatrons(runs):
    root = runs["tmp"] / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    for it in (1, 2):
        files = os.listdir(root / f"iter_{it:07d}")
        assert "metadata.json" in files and "common.pt" in files
        assert any(f.endswith(".distcp") for f in files)


def test_same_layout_resume_is_bit_identical(runs):
    for r in runs["dp2"]:
        assert r["at_same"] == 2
        assert r["same"] == r["full"][2:]  # exact: data position, LR schedule, optimizer


def test_resume_at_other_layouts_matches_uninterrupted_run(runs):
    full = runs["dp2"][0]["full"]
    for r in runs["dp2"]:  # DP 2 -> CP 2
        assert r["at_cp"] == 2
        torch.testing.assert_close(r["cp"], full[2:], rtol=1e-9, atol=0)
    dp1 = runs["dp1"]  # DP 2 -> DP 1 (one process)
    assert dp1["at_dp1"] == 2
    torch.testing.assert_close(dp1["dp1"], full[2:], rtol=1e-9, atol=0)


def test_corrupt_newest_falls_back_to_previous(runs):
    dp1, full = runs["dp1"], runs["dp2"][0]["full"]
    assert dp1["at_fallback"] == 1
    assert len(dp1["errors"]) == 1
    assert "iter_0000002 is unreadable" in dp1["errors"][0]
    assert "resuming from the previous intact checkpoint" in dp1["errors"][0]
    assert "iter_0000001" in dp1["errors"][0]
    torch.testing.assert_close(dp1["fallback"], full[1:], rtol=1e-9, atol=0)
    assert dp1["tracker"] == "4"  # iteration 3 was written over the killed save's debris


def test_bad_load_inputs(runs):
    dp1 = runs["dp1"]
    assert "no such directory" in dp1["missing"]
    assert "another model" in dp1["other_model"] and "hidden_size" in dp1["other_model"]
    assert dp1["finetune"] == 0
