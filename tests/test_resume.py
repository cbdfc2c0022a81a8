"""Resume semantics as Megatron's: the padded vocabulary belongs to the model, whose LR
schedule wins (``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``),
the distributed optimizer at DP x CP = 1, and Megatron's hybrid-CP flags.

One spawn of 2 gloo ranks (float64) and two launcher runs.  The vocabulary is byte-level
sized (262 ids) with the default ``--make-vocab-size-divisible-by 128``: 384 rows at TP 1,
512 if a TP-2 run padded it again.  Saved at DP 2 and at CP 2, resumed at TP 2, the losses
must be the uninterrupted run's.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from mcore_helpers import TINY_FLAGS, drop_flag, spawn, tiny_config
from test_checkpointing import FLAGS, _load, _setup

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = FLAGS + ["--vocab-size", "262"]  # a byte-level vocabulary's size (ByteLevelTokenizer)
TP2, CP2 = ["--tensor-model-parallel-size", "2"], ["--context-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
HYBRID = ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "64"]


def _train(trainer, iters, save_to=None, cfg=None):
    """``[(loss, lr)]`` of iterations ``trainer.iteration + 1 .. iters`` (optionally saving
    each one)."""
    import dataclasses

    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.training import train

    save_fn = None
    if save_to:
        meta = ckpt.CheckpointMeta.from_parallel_state()
        desc = dataclasses.asdict(cfg)
        save_fn = lambda t: ckpt.save_checkpoint(save_to, t, meta, desc)  # noqa: E731
    return [(s.loss, s.lr) for s in train(trainer, train_iters=iters, save_interval=1,
                                          save_fn=save_fn)]


def _rows(trainer, cfg):
    from megatron.skrull.checkpointing import _unwrap

    local = _unwrap(trainer.model).embedding.word_embeddings.weight.shape[0]
    return local * cfg.parallel.tensor_model_parallel_size


def _resume(tmp, src, flags, iters=4):
    """``{rows, at, run}`` of a run built with ``flags`` + ``--load src`` and resumed."""
    cfg = tiny_config(BASE + flags + ["--load", f"{tmp}/{src}"], world_size=2)
    trainer = _setup(cfg)
    at = _load(f"{tmp}/{src}", trainer, cfg)
    return {"rows": _rows(trainer, cfg), "at": at, "run": _train(trainer, iters)}


def _megatron_hybrid_config(world):
    """Megatron's hybrid-CP flags, without --skrull-bucket-size (DP 2 x CP 1 as written)."""
    from megatron.skrull.arguments import parse_args

    flags = drop_flag(list(TINY_FLAGS) + BASE, "--skrull-bucket-size")
    return parse_args(flags + HYBRID, world_size=world)


def _schedules(tmp, out):
    """Saved with --train-iters 4, resumed with 6: an error, or whose schedule wins."""
    from megatron.skrull.checkpointing import CheckpointError

    longer = ["--train-iters", "6"]
    try:
        _resume(tmp, "dp2", longer)
        out["extend_error"] = None
    except CheckpointError as exc:
        out["extend_error"] = str(exc)
    out["override"] = _resume(tmp, "dp2", longer + ["--lr", "6e-3",
                                                    "--override-opt_param-scheduler"], 6)
    out["use_checkpoint"] = _resume(tmp, "dp2", longer + [
        "--lr", "6e-3", "--use-checkpoint-opt_param-scheduler"], 6)


def _worker(rank, world, tmp):
    out = {}
    dp2 = tiny_config(BASE, world_size=2)
    trainer = _setup(dp2)
    out["full"], out["rows"] = _train(trainer, 4), _rows(trainer, dp2)
    _train(_setup(dp2), 2, save_to=f"{tmp}/dp2", cfg=dp2)
    cp2 = tiny_config(BASE + CP2, world_size=2)
    _train(_setup(cp2), 2, save_to=f"{tmp}/cp2", cfg=cp2)
    out["dp2_tp2"] = _resume(tmp, "dp2", TP2)
    out["cp2_tp2"] = _resume(tmp, "cp2", TP2)
    # The distributed optimizer with nothing to shard over (TP 2: DP x CP = 1): loads a
    # plain optimizer's checkpoint, trains and saves; the plain optimizer resumes that.
    out["dp2_tp2_dist"] = _resume(tmp, "dp2", TP2 + DIST)
    # (Divisible-by 64 pads to 384 rows at TP 2, as the default does at TP 1: the same
    # model; the padding rule is not compared on resume.)
    tp2d = tiny_config(BASE + TP2 + DIST + ["--make-vocab-size-divisible-by", "64"],
                       world_size=2)
    out["tp2_dist"] = _train(_setup(tp2d), 2, save_to=f"{tmp}/tp2d", cfg=tp2d)
    out["tp2d_dp2"] = _resume(tmp, "tp2d", [])
    _schedules(tmp, out)
    from megatron.skrull.training import train

    hybrid = _megatron_hybrid_config(2)
    stats = train(_setup(hybrid), train_iters=4)
    out["hybrid"] = {"run": [(s.loss, s.lr) for s in stats],
                     "local": [s.local_share for s in stats],
                     "layout": [hybrid.parallel.dp_size, hybrid.parallel.context_parallel_size],
                     "policy": hybrid.skrull.scheduler}
    with open(os.path.join(tmp, f"out{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    spawn(_worker, 2, tmp, timeout=600)
    return {"ranks": [json.load(open(tmp / f"out{r}.json")) for r in range(2)], "tmp": tmp}


def _losses(run):
    return [loss for loss, _ in run]


def test_resume_at_tp2_keeps_the_checkpoints_padded_vocabulary(runs):
    assert tiny_config(BASE + TP2, world_size=2).model.padded_vocab_size(262, 2) == 512
    for r in runs["ranks"]:
        full = _losses(r["full"])
        assert r["rows"] == 384
        for key in ("dp2_tp2", "cp2_tp2"):  # DP 2 -> TP 2 and CP 2 -> TP 2
            assert r[key]["rows"] == 384 and r[key]["at"] == 2
            torch.testing.assert_close(_losses(r[key]["run"]), full[2:], rtol=1e-9, atol=0)


def test_checkpoint_rows_decide_or_name_the_fix(runs, tmp_path, monkeypatch):
    from megatron.skrull import vocab

    assert vocab.saved_rows(str(runs["tmp"] / "dp2")) == 384  # from the tensor metadata
    assert vocab.saved_rows(str(tmp_path / "none")) is None
    cfg = tiny_config(BASE + TP2 + ["--load", str(tmp_path)], world_size=2)
    for rows, needle in ((263, "--make-vocab-size-divisible-by"), (200, "fewer than")):
        monkeypatch.setattr(vocab, "saved_rows", lambda root, rows=rows: rows)
        with pytest.raises(ValueError) as err:
            vocab.padded_vocab_size(cfg, 64)
        assert needle in str(err.value) and str(rows) in str(err.value)
    monkeypatch.setattr(vocab, "saved_rows", lambda root: 264)
    assert vocab.padded_vocab_size(cfg, 64) == 264  # the flags would pad 262 to 512


def test_distributed_optimizer_at_dp_cp_one_trains_saves_and_resumes(runs):
    for r in runs["ranks"]:
        full = _losses(r["full"])
        loaded = r["dp2_tp2_dist"]  # plain DP-2 checkpoint -> distributed optimizer, TP 2
        assert loaded["at"] == 2
        torch.testing.assert_close(_losses(loaded["run"]), full[2:], rtol=1e-9, atol=0)
        # Trained from scratch (iterations 1-2), saved, resumed by the plain optimizer at
        # DP 2 (3-4): the uninterrupted plain run's losses (fp32 state in between, 1e-9).
        chained = _losses(r["tp2_dist"]) + _losses(r["tp2d_dp2"]["run"])
        torch.testing.assert_close(chained, full, rtol=1e-9, atol=0)


def test_changed_schedule_needs_one_of_megatrons_flags(runs):
    full = runs["ranks"][0]["full"]
    error = runs["ranks"][0]["extend_error"]
    assert error is not None and "--override-opt_param-scheduler" in error
    assert "--use-checkpoint-opt_param-scheduler" in error and "saved 4, now 6" in error
    from megatron.skrull.optimizer import build_scheduler

    class _Groups:  # the flags' own schedule, stepped without an optimizer
        param_groups = [{}]

    cfg = tiny_config(BASE + ["--train-iters", "6", "--lr", "6e-3"])
    schedule, expected = build_scheduler(_Groups(), cfg.optim), []
    for _ in range(6):
        expected.append(_Groups.param_groups[0]["lr"])
        schedule.step(increment=1)
    for r in runs["ranks"]:
        over, keep = r["override"], r["use_checkpoint"]
        assert over["at"] == keep["at"] == 2
        # The flags win: their LR (6e-3, decayed over 6 iterations) from iteration 3 on.
        assert [lr for _, lr in over["run"]] == pytest.approx(expected[2:], rel=1e-12)
        assert over["run"][0][1] != full[2][1]
        # The checkpoint wins: its 4-iteration schedule, the uninterrupted run's losses.
        assert [lr for _, lr in keep["run"]] == pytest.approx(
            [lr for _, lr in full[2:]] + [0.0, 0.0], rel=1e-12)
        torch.testing.assert_close(_losses(keep["run"])[:2], _losses(full)[2:], rtol=1e-9,
                                   atol=0)


def test_megatron_hybrid_cp_flags_train_the_same_model(runs):
    for r in runs["ranks"]:
        h = r["hybrid"]
        assert h["layout"] == [1, 2] and h["policy"] == "hybrid-cp"  # DP 2 x CP 1 -> one pool
        assert min(h["local"]) < 1.0  # samples over 64 tokens span two ranks of the pool
        torch.testing.assert_close(_losses(h["run"]), _losses(r["full"]), rtol=1e-9, atol=0)


def _launch(*flags):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY_FLAGS,
                           *BASE, *flags], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


def _snapshot(root):
    return sorted((os.path.relpath(os.path.join(d, f), root),
                   os.path.getmtime(os.path.join(d, f)))
                  for d, _, files in os.walk(root) for f in files)


def test_launcher_refuses_a_changed_schedule_and_writes_nothing(runs, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(runs["tmp"] / "dp2", ckpt)
    before = _snapshot(ckpt)
    proc = _launch("--train-iters", "6", "--load", ckpt, "--save", ckpt)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "--override-opt_param-scheduler" in line
    assert "--use-checkpoint-opt_param-scheduler" in line
    assert _snapshot(ckpt) == before


def test_launcher_one_process_with_the_distributed_optimizer(runs, tmp_path):
    """--use-distributed-optimizer on one process (DP x CP = 1) resumes the DP-2 checkpoint
    and saves: Megatron runs it, and so do we."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(runs["tmp"] / "dp2", ckpt)
    proc = _launch(*DIST, "--load", ckpt, "--save", ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 1 = DP 1 x CP 1" in proc.stdout and "distributed optimizer on" in proc.stdout
    got = {int(it): float(loss) for it, loss in
           re.findall(r" iteration +(\d+)/ *\d+ \|.*? lm loss: ([-+.\dE]+)",
                      proc.stdout)}
    full = _losses(runs["ranks"][0]["full"])
    assert sorted(got) == [3, 4]
    assert [got[3], got[4]] == pytest.approx(full[2:], rel=2e-6)  # 7 printed digits
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "4"
