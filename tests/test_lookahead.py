"""``--skrull-lookahead N``: windows of N global batches planned together.

The window planner (``skrull_ext.scheduler.lookahead``): a permutation of the window with
the drawn batch sizes, deterministic, N = 1 the identity, kept only when the judge says
faster.  The sampler layer (``megatron.skrull.lookahead``): every sample once per epoch,
windows inside epochs, exact resume mid-window, a different N refused.  One spawn (2 gloo
ranks, fp64) trains with N = 2, resumes mid-window with the uninterrupted run's losses and
refuses a resume with N = 1; one launch shows the launcher's single error line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mcore_helpers import TINY_FLAGS, spawn, tiny_config
from megatron.skrull.batch_schedule import make_batch_scheduler
from megatron.skrull.data import GlobalBatchSampler
from megatron.skrull.lookahead import STATE_KEY, LookaheadSampler, lookahead_sampler
from megatron.skrull.plan_ahead import PlannedBatches
from megatron.skrull.samples import SyntheticSFTSource
from skrull_ext.scheduler.lookahead import grouped_window, plan_window, window_span

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
FLAGS = ["--fp64", "--skrull-bucket-size", "128", "--train-iters", "3", "--skrull-lookahead",
         "2"]
CP2 = ["--context-parallel-size", "2"]  # there the judge regroups the first window


def _tiny(extra=(), world_size=2):
    """The spawn test's run: config, its mock lengths and its batch scheduler."""
    cfg = tiny_config(FLAGS + list(extra), world_size=world_size)
    source = SyntheticSFTSource(cfg.data.mock_num_samples, cfg.seq_length, vocab_size=64,
                                seed=cfg.optim.seed)
    return cfg, source.lengths, make_batch_scheduler(cfg, 64)


def _sampler(lengths, n, sched, gbs=6, seed=1234):
    return lookahead_sampler(GlobalBatchSampler(len(lengths), gbs, seed), lengths, n, sched)


def _batches(sampler, count):
    return [list(next(sampler)) for _ in range(count)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=6),
       st.lists(st.integers(1, 5000), min_size=48, max_size=48))
def test_grouped_window_is_a_permutation_with_the_drawn_sizes(sizes, values):
    lengths = np.array(values, dtype=np.int64)
    ids = np.random.default_rng(len(sizes)).permutation(48)[:sum(sizes)]
    drawn = np.split(ids, np.cumsum(sizes)[:-1])
    out = grouped_window(drawn, lengths)
    assert [len(b) for b in out] == sizes
    assert sorted(np.concatenate(out).tolist()) == sorted(ids.tolist())
    rank = {int(i): k for k, i in enumerate(ids)}
    for b in out:  # samples keep their drawn relative order
        assert [rank[int(i)] for i in b] == sorted(rank[int(i)] for i in b)
    again = grouped_window([d.copy() for d in drawn], lengths.copy())
    assert all(np.array_equal(a, b) for a, b in zip(out, again))


def test_grouped_window_groups_lengths_and_evens_tokens():
    lengths = np.array([9000, 8000, 7000, 50, 40, 30, 20, 10, 5000, 60, 70, 80], np.int64)
    drawn = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)]  # long ones in batch 0
    out = grouped_window(drawn, lengths)
    tokens = [int(lengths[b].sum()) for b in out]
    assert max(tokens) < max(int(lengths[b].sum()) for b in drawn)
    assert [int(lengths[b].max()) for b in out] == [9000, 8000, 7000]  # one long each


def test_plan_window_keeps_the_drawn_batches_unless_faster():
    lengths = np.array([900, 800, 10, 20, 700, 30, 40, 50], np.int64)
    drawn = [np.arange(0, 4), np.arange(4, 8)]
    calls = []

    def flat(x):
        calls.append(len(x))
        return 1.0

    one = plan_window(drawn[:1], lengths, flat)  # N = 1: identity, never judged
    assert one.candidate == "drawn" and not calls
    assert np.array_equal(one.batches[0], drawn[0])
    tie = plan_window(drawn, lengths, flat)
    assert tie.candidate == "drawn" and all(np.array_equal(a, b)
                                            for a, b in zip(tie.batches, drawn))
    even = plan_window(drawn, lengths, lambda x: float(x.sum()) ** 2)  # tokens 1730, 820
    assert even.reordered and sum(even.times) < sum(even.drawn_times)
    assert [int(lengths[b].sum()) for b in even.batches] == [960, 1590]
    assert even.times == tuple(float(lengths[b].sum()) ** 2 for b in even.batches)


def test_window_span_stays_inside_epochs():
    assert window_span(0, 3) == (0, 3) and window_span(5, 3) == (3, 6)
    assert [window_span(i, 3, 8) for i in (0, 4, 6, 7, 8, 11)] == [
        (0, 3), (3, 6), (6, 8), (6, 8), (8, 11), (11, 14)]
    assert window_span(9, 1, 8) == (9, 10)


def test_every_sample_once_per_epoch_gbs_per_iteration_and_deterministic():
    _, lengths, sched = _tiny()
    base = GlobalBatchSampler(len(lengths), 6, 1234)  # 10 batches per epoch: windows 3,3,3,1
    drawn = _batches(base, 20)
    sampler = _sampler(lengths, 3, sched)
    got = _batches(sampler, 20)
    assert all(len(b) == 6 for b in got)
    for epoch in (0, 1):
        ours = sorted(i for b in got[10 * epoch:10 * epoch + 10] for i in b)
        assert ours == sorted(i for b in drawn[10 * epoch:10 * epoch + 10] for i in b)
        assert len(set(ours)) == 60
    for w in range(0, 20, 10):  # each window a permutation of its drawn samples
        for lo, hi in ((0, 3), (3, 6), (6, 9), (9, 10)):
            assert (sorted(sum(got[w + lo:w + hi], []))
                    == sorted(sum(drawn[w + lo:w + hi], [])))
    assert sampler.windows_grouped > 0 and got != drawn  # the judge did regroup
    assert _batches(_sampler(lengths, 3, sched), 20) == got  # same on every rank / run


def test_judge_calls_are_spread_over_the_previous_window():
    _, lengths, _ = _tiny()
    calls = []

    def judge(x):  # favours even token counts: grouping usually wins
        calls.append(len(x))
        return float(x.sum()) ** 2

    sampler = LookaheadSampler(GlobalBatchSampler(len(lengths), 6, 1234), lengths, 4, judge)
    per_iteration = []
    for _ in range(12):  # 10 batches per epoch: windows [0, 4), [4, 8), [8, 10), [10, 14)
        before = len(calls)
        next(sampler)
        per_iteration.append(len(calls) - before)
    assert sampler.windows_grouped >= 2
    assert per_iteration[0] <= 8 + 2  # the first window at once, then 2 of the next
    assert max(per_iteration[1:8]) <= 2  # windows of 4 (then 2): <= 2 calls per iteration
    assert max(per_iteration[8:]) <= 4  # a window of 2 judges the next 4 batches


def test_a_blend_sampler_is_regrouped_window_by_window_and_resumes():
    from megatron.skrull.blend import BlendedBatchSampler

    _, lengths, sched = _tiny()  # 64 samples as a blend of 24 + 40 (no epochs: windows of 3)
    blend = lambda: BlendedBatchSampler([24, 40], [0.3, 0.7], 6, 1)  # noqa: E731
    drawn = _batches(blend(), 9)
    sampler = lookahead_sampler(blend(), lengths, 3, sched)
    got = _batches(sampler, 9)
    for lo in (0, 3, 6):
        assert sorted(sum(got[lo:lo + 3], [])) == sorted(sum(drawn[lo:lo + 3], []))
    assert sampler.windows_grouped > 0 and got != drawn
    resumed = lookahead_sampler(blend(), lengths, 3, sched)
    again = lookahead_sampler(blend(), lengths, 3, sched)
    _batches(again, 4)
    resumed.load_state_dict(again.state_dict())  # iteration 4: mid-window [3, 6)
    assert _batches(resumed, 5) == got[4:]
    # The blend's per-dataset counts (the log line) come through the wrapper.
    assert sampler.consumed_per_dataset(6) == blend().consumed_per_dataset(6)


def test_lookahead_one_is_the_drawn_sampler_bit_for_bit():
    _, lengths, sched = _tiny()
    base = GlobalBatchSampler(len(lengths), 6, 1234)
    ours = _sampler(lengths, 1, sched)
    assert _batches(ours, 12) == _batches(base, 12)
    assert ours.state_dict() == base.state_dict() and STATE_KEY not in ours.state_dict()


def test_regrouped_batches_keep_every_rank_within_its_bucket():
    cfg, lengths, sched = _tiny(["--context-parallel-size", "2"])
    sampler = _sampler(lengths, 4, sched)
    for ids in _batches(sampler, 10):
        plan = sched(lengths[np.asarray(ids)])
        plan.validate()
        for mbs in plan.dp_ranks:
            for mb in mbs:
                assert max(mb.rank_tokens(plan.lengths)) <= cfg.skrull.bucket_size
    assert sampler.windows_grouped > 0


@pytest.mark.parametrize("ahead", [False, True])
def test_resume_mid_window_replays_the_same_batches(ahead):
    _, lengths, sched = _tiny()
    full = PlannedBatches(_sampler(lengths, 3, sched), lengths, sched, ahead=ahead)
    ids = []
    for i in range(7):
        if i == 2:  # the third iteration of window [0, 3), which the judge regroups
            state = full.state_dict()
        ids.append(full.take()[0].tolist())
        full.prefetch()
    assert state["iteration"] == 2 and state[STATE_KEY] == 3
    resumed = PlannedBatches(_sampler(lengths, 3, sched), lengths, sched, ahead=ahead)
    resumed.load_state_dict(state)
    assert resumed.sampler.last_window.reordered  # recomputed from the window's start
    assert [resumed.take()[0].tolist() for _ in range(5)] == ids[2:]
    # Rewinding the batch drawn ahead (the end of training) stays inside the planned
    # window [6, 9): no re-planning.
    planned = full.sampler.windows_planned
    full.cancel()
    assert full.take()[0].tolist() == resumed.take()[0].tolist()
    assert full.sampler.windows_planned == planned
    for b in (full, resumed):
        b.close()


def test_a_state_of_another_lookahead_is_refused():
    _, lengths, sched = _tiny()
    two = _sampler(lengths, 2, sched)
    _batches(two, 3)
    for n, state in ((1, two.state_dict()), (3, two.state_dict()),
                     (2, _sampler(lengths, 1, sched).state_dict())):
        with pytest.raises(ValueError, match=r"--skrull-lookahead \d but this run has "
                                             rf"--skrull-lookahead {n}; resume with"):
            _sampler(lengths, n, sched).load_state_dict(state)


def test_flag():
    assert tiny_config().skrull.lookahead == 1
    assert tiny_config(["--skrull-lookahead", "4"]).skrull.lookahead == 4
    with pytest.raises(ValueError, match="--skrull-lookahead 0: use an integer in"):
        tiny_config(["--skrull-lookahead", "0"])
    with pytest.raises(ValueError, match="N > 1 needs"):
        LookaheadSampler(GlobalBatchSampler(8, 2, 0), np.ones(8, np.int64), 2)


def _resume_worker(rank, world, tmp):
    """N = 2 at CP 2: 3 iterations saving each; resume at iteration 1 (mid-window
    [0, 2)); then the same checkpoint under N = 1."""
    import dataclasses

    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.training import train
    from test_checkpointing import _load, _setup

    cfg = tiny_config(FLAGS + CP2, world_size=2)
    trainer = _setup(cfg)
    meta, desc = ckpt.CheckpointMeta.from_parallel_state(), dataclasses.asdict(cfg)
    full = [s.loss for s in train(trainer, train_iters=3, save_interval=1, save_fn=lambda t:
                                  ckpt.save_checkpoint(f"{tmp}/ckpt", t, meta, desc))]
    if rank == 0:  # a root whose latest checkpoint is iteration 1
        shutil.copytree(f"{tmp}/ckpt/iter_0000001", f"{tmp}/mid/iter_0000001")
        with open(f"{tmp}/mid/latest_checkpointed_iteration.txt", "w") as f:
            f.write("1")
    torch.distributed.barrier()
    resumed = _setup(cfg)
    at = _load(f"{tmp}/mid", resumed, cfg)
    window = resumed.sampler.sampler.last_window
    out = {"full": full, "at": at, "regrouped": window.reordered,
           "resumed": [s.loss for s in train(resumed, train_iters=3)]}
    other = tiny_config(FLAGS[:-1] + ["1"] + CP2, world_size=2)
    try:
        _load(f"{tmp}/mid", _setup(other), other)
        out["mismatch"] = None
    except ckpt.CheckpointError as exc:
        out["mismatch"] = str(exc)
    with open(os.path.join(tmp, f"out{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.multiprocess
def test_resume_mid_window_equals_the_uninterrupted_run_and_another_n_is_refused(tmp_path):
    spawn(_resume_worker, 2, tmp_path, timeout=300)
    for rank in (0, 1):
        out = json.load(open(tmp_path / f"out{rank}.json"))
        assert out["at"] == 1 and out["regrouped"]  # window [0, 2) recomputed, regrouped
        torch.testing.assert_close(out["resumed"], out["full"][1:], rtol=0, atol=0)
        assert out["mismatch"].startswith("--load ")
        assert "planned with --skrull-lookahead 2 but this run has --skrull-lookahead 1" in (
            out["mismatch"])
    # The launcher: one error line, exit 2 (world 1 resumes the CP-2 checkpoint).
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY_FLAGS,
                           *FLAGS[:-1], "3", "--load", str(tmp_path / "mid")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "--skrull-lookahead 2 but this run has --skrull-lookahead 3" in line
