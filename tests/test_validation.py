"""Validation (``--split``, ``--valid-data-path``, ``--eval-interval``, ``--eval-iters``).

Unit tests of the split; one world-1 spawn (the reference) and one 2-process spawn (CP 2,
the launcher's skrull planner distributing the long samples, distributed optimizer with
overlapped param gather) compare fp64 validation losses; the training losses with and
without evaluation are bit-identical (with dropout, so the RNG state counts); the launcher
logs Megatron's line at the right iterations and a resumed run logs the same values.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from mcore_helpers import TINY_FLAGS, spawn, tiny_config

from megatron.skrull.samples import SubsetSource, SyntheticSFTSource, parse_split, split_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


# --- the split --------------------------------------------------------------------------

def test_split_is_normalised_like_megatron():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.03, 0.001), abs=1e-15)
    assert parse_split("98, 2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1/1/2") == pytest.approx((0.25, 0.25, 0.5))
    assert parse_split("3") == (1.0, 0.0, 0.0)
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0", "1,,2", "inf,1"):
        with pytest.raises(ValueError, match="--split .* e.g. --split 969,30,1"):
            parse_split(bad)


def test_split_ranges_are_megatrons_contiguous_rounded_ranges():
    # Megatron: [round(c_k * N), round(c_{k+1} * N)) with c the cumulative weights.
    assert split_ranges(2000, parse_split("969,30,1")) == [(0, 1938), (1938, 1998), (1998, 2000)]
    assert split_ranges(64, parse_split("80,20")) == [(0, 51), (51, 64), (64, 64)]
    for n in (1, 7, 100, 1001):
        ranges = split_ranges(n, parse_split("7,2,1"))
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # disjoint, covering
    # Python's round, as Megatron: half to even (2.5 -> 2).
    assert split_ranges(5, parse_split("1,1")) == [(0, 2), (2, 5), (5, 5)]


def test_split_parts_are_disjoint_views_of_the_source():
    from megatron.skrull.data import build_sample_sources

    cfg = tiny_config(["--split", "70,20,10"])
    sources = build_sample_sources(cfg)
    base = SyntheticSFTSource(64, 96, seed=cfg.optim.seed)
    train, valid = sources.train, sources.valid
    assert isinstance(train, SubsetSource) and isinstance(valid, SubsetSource)
    assert (len(train), len(valid)) == (45, 13)
    assert not set(train.indices) & set(valid.indices)
    np.testing.assert_array_equal(valid.lengths, base.lengths[45:58])
    np.testing.assert_array_equal(valid.sample(2).tokens, base.sample(47).tokens)
    assert valid.num_loss_tokens(np.array([0, 2])) == base.num_loss_tokens(np.array([45, 47]))
    assert "validation part [45, 58) of the 64 samples" in sources.valid_origin
    plain = build_sample_sources(tiny_config())  # no --split: everything trains, as before
    assert isinstance(plain.train, SyntheticSFTSource) and plain.valid is None


def test_flag_problems():
    from megatron.skrull.arguments import ConfigError

    for extra, needle in ((["--split", "9,x"], "--split '9,x'"),
                          (["--eval-interval", "0"], "--eval-interval must be >= 1"),
                          (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
                          (["--valid-data-path", "v"], "--valid-data-path needs --data-path")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            tiny_config(extra)


def test_validation_set_problems_name_the_fix():
    from megatron.skrull.data import build_sample_sources
    from megatron.skrull.evaluation import build_evaluator

    def problem(extra):
        cfg = tiny_config(extra)
        with pytest.raises(ValueError) as info:
            build_evaluator(cfg, build_sample_sources(cfg), None)
        return str(info.value)

    assert "there is no validation set" in problem(["--eval-iters", "3"])
    assert "--split with a validation weight" in problem(["--eval-interval", "5"])
    assert "is empty" in problem(["--split", "100,0,1", "--eval-iters", "3"])
    assert "fewer than one --global-batch-size 6" in problem(["--split", "95,5", "--eval-iters",
                                                              "1"])
    # A validation set with no eval flags: Megatron's default, 100 batches at the end.
    from megatron.skrull.batch_schedule import make_batch_scheduler

    cfg = tiny_config(["--split", "1,1"])
    ev = build_evaluator(cfg, build_sample_sources(cfg), make_batch_scheduler(cfg, 128))
    assert len(ev.batches) == 100 and ev.eval_interval is None
    assert {len(ids) for ids, _ in ev.batches} == {6}
    assert build_evaluator(tiny_config(["--split", "1,1", "--eval-iters", "0"]),
                           build_sample_sources(cfg), None) is None
    assert build_evaluator(tiny_config(), build_sample_sources(tiny_config()), None) is None


# --- fp64 parity, eval does not change training -----------------------------------------

COMMON = ["--fp64", "--split", "70,30", "--eval-interval", "2", "--eval-iters", "2",
          "--train-iters", "3", "--lr-decay-style", "constant"]
CP2 = ["--context-parallel-size", "2", "--skrull-bucket-size", "48",
       "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _run(flags, world, *, evaluate=True, init=None):
    """Trains ``flags`` for 3 iterations; with ``evaluate`` validates as the launcher does.

    ``init``: the reference's initial weights, sliced per pipeline stage (PP runs).
    """
    from megatron.core import parallel_state
    from megatron.skrull.data import build_sample_sources
    from megatron.skrull.evaluation import build_evaluator
    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel
    from megatron.skrull.training import train
    from test_pipeline_training import _pipeline_trainer, _tensors

    cfg = tiny_config(flags, world_size=world)
    parallel_state.destroy_model_parallel()
    sources = build_sample_sources(cfg)
    if init is None:
        init_model_parallel(cfg, CPU)
        trainer = build_trainer(cfg, CPU, source=sources.train)
    else:
        trainer = _pipeline_trainer(cfg, init)
    initial = _tensors(trainer.model.module)
    ev = build_evaluator(cfg, sources, trainer.batch_scheduler, device=CPU)
    first = ev.loss(trainer)
    history = train(trainer, train_iters=3, evaluator=ev if evaluate else None)
    return {"first": first, "losses": [s.loss for s in history], "evals": ev.history,
            "init": initial,
            "data": trainer.sampler.state_dict(),
            "local_share": [plan.local_token_share() for _, plan in ev.batches]}


def _reference(rank, world, tmp):
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    torch.save(_run(COMMON, 1), os.path.join(tmp, "reference.pt"))


def _worker(rank, world, tmp, ref_path):
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    init = torch.load(os.path.join(ref_path, "reference.pt"), weights_only=False)["init"]
    out = {"cp2": _run(COMMON + CP2, 2),
           "pp2": _run(COMMON + ["--pipeline-model-parallel-size", "2"], 2, init=init),
           "dropout_eval": _run(COMMON + CP2 + ["--hidden-dropout", "0.2"], 2),
           "dropout_plain": _run(COMMON + CP2 + ["--hidden-dropout", "0.2"], 2, evaluate=False)}
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp, ref_tmp = tmp_path_factory.mktemp("validation"), tmp_path_factory.mktemp("reference")
    spawn(_reference, 1, ref_tmp, timeout=120)
    spawn(_worker, 2, tmp, str(ref_tmp), timeout=300)
    ranks = [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False) for r in range(2)]
    return torch.load(os.path.join(ref_tmp, "reference.pt"), weights_only=False), ranks


@pytest.mark.multiprocess
def test_cp2_and_pp2_validation_losses_match_one_process(results):
    ref, ranks = results
    assert [it for it, _ in ref["evals"]] == [2, 3]
    assert min(ranks[0]["cp2"]["local_share"]) < 1.0  # the skrull plans shard some samples
    for got in [r[case] for r in ranks for case in ("cp2", "pp2")]:
        torch.testing.assert_close(got["first"], ref["first"], rtol=1e-9, atol=0)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-9, atol=0)
        assert [it for it, _ in got["evals"]] == [2, 3]
        torch.testing.assert_close([v for _, v in got["evals"]], [v for _, v in ref["evals"]],
                                   rtol=1e-9, atol=0)
    assert ref["evals"][-1][1] < ref["first"]  # the model learns


@pytest.mark.multiprocess
def test_evaluation_does_not_change_training(results):
    _, ranks = results
    for r in ranks:
        with_eval, plain = r["dropout_eval"], r["dropout_plain"]
        assert with_eval["losses"] == plain["losses"]  # bit-identical, dropout on
        assert with_eval["data"] == plain["data"]
        assert len(with_eval["evals"]) == 2 and plain["evals"] == []
    assert ranks[0]["dropout_eval"]["losses"] != ranks[0]["cp2"]["losses"]  # dropout is on


# --- the launcher: log lines, early exit, resume ----------------------------------------

def _launch(*flags):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY_FLAGS,
                           "--fp64", "--split", "80,20", "--eval-iters", "1", *flags],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return re.findall(r" validation loss at iteration (\d+( on validation set)?) \| lm loss "
                      r"value: (\S+) \| lm loss PPL: (\S+) \|", proc.stdout)


@pytest.mark.multiprocess
def test_launcher_logs_validation_and_resume_repeats_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = _launch("--train-iters", "4", "--eval-interval", "2")
    assert [it for it, _, _, _ in full] == ["2", "4", "4 on validation set"]
    assert full[1][2] == full[2][2]  # the closing evaluation of the same model: same value
    loss, ppl = float(full[0][2]), float(full[0][3])
    assert ppl == pytest.approx(np.exp(loss), rel=1e-6)
    # Stopped early by --exit-interval: no closing evaluation (Megatron exits too).
    first = _launch("--train-iters", "4", "--eval-interval", "2", "--exit-interval", "2",
                    "--save", ckpt, "--save-interval", "2")
    assert first == full[:1]
    resumed = _launch("--train-iters", "4", "--eval-interval", "2", "--load", ckpt)
    assert resumed == full[1:]
