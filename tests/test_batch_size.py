"""Megatron's batch-size schedules without processes: ``--step-batch-size-schedule`` parsing
(Megatron-LM d98e8a64's rules), mcore's ``--rampup-batch-size`` ramp, ``--train-samples`` ->
iterations, the flags' rules and errors, and the samplers that hand out scheduled global
batches (one dataset and weighted blends; exact resume state)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mcore_helpers import TINY_FLAGS, drop_flag, tiny_config
from megatron.skrull.arguments import parse_args
from megatron.skrull.batch_size import (BatchSizeArgs, GlobalBatchSizes, megatron_train_iters,
                                        parse_count, parse_step_schedule, step_batch_size)
from megatron.skrull.batch_size_samplers import (ScheduledBatchSampler,
                                                 ScheduledBlendedBatchSampler)
from megatron.skrull.blend import BlendedBatchSampler
from megatron.skrull.data import GlobalBatchSampler
from megatron.skrull.errors import ConfigError

GPT3 = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # train_gpt3_175b_distributed.sh


def _step(schedule, seq_length=1, final=None):
    final = final or parse_step_schedule(schedule, seq_length)[-1][1]
    return BatchSizeArgs(step_batch_size_schedule=schedule, global_batch_size=final,
                         seq_length=seq_length)


def test_the_gpt3_script_schedule_parses_as_megatron_does():
    assert [parse_count(x) for x in ("2.4B", "12b", "0.5K", "3M", "1T", "7")] == [
        2_400_000_000, 12_000_000_000, 500, 3_000_000, 10 ** 12, 7]
    # Thresholds are tokens; at --seq-length 2048 the last one is the old ramp's 5859375.
    assert parse_step_schedule(GPT3, 2048) == (
        (0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232),
        (5859375, 1536))
    # Commas, any order, suffixed batch sizes.
    assert parse_step_schedule("4K:2K, 0:1K", 1) == ((0, 1000), (4000, 2000))
    for bad, needle in (("0:1 5", 'Invalid schedule entry "5"'),
                        ("0:1 x:2", "numbers with an optional"),
                        ("100:4 800:8", "first schedule entry must have threshold 0, got 1"),
                        ("0:4 100:8 199:9", "strictly increasing, got 1 before 1"),
                        ("0:4 1K:0", "batch size must be positive, got 0"), ("", "one entry")):
        with pytest.raises(ValueError, match=needle):
            parse_step_schedule(bad, 100)


def test_step_lookup_is_the_last_threshold_reached():
    schedule = parse_step_schedule("0:2 10:5 30:7", 1)
    for consumed in range(0, 50):
        # Megatron-LM's linear scan, written out.
        expected = [bs for threshold, bs in schedule if consumed >= threshold][-1]
        assert step_batch_size(schedule, consumed) == expected


def test_global_batch_sizes_follow_consumed_samples():
    sizes = GlobalBatchSizes(_step("0:2 5:3 12:4"))
    consumed, brute = 0, []
    for _ in range(12):
        brute.append((consumed, step_batch_size(((0, 2), (5, 3), (12, 4)), consumed)))
        consumed += brute[-1][1]
    # Out-of-order queries (the cache and the closed form past the last threshold agree).
    for it in (11, 0, 5, 3, 9):
        assert (sizes.consumed_before(it), sizes.size(it)) == brute[it]
    assert [sizes.size(i) for i in range(6)] == [2, 2, 2, 3, 3, 4]
    assert sizes.settled_iteration(3) is None and sizes.settled_iteration(40) == 5


def test_rampup_is_mcores_and_train_samples_count_as_megatron():
    # mcore's ramp: (1 -> 3 by 1 over 4 samples) = 2 increments of 2.0 samples each.
    ramp = BatchSizeArgs(rampup_batch_size=(1, 1, 4), global_batch_size=3, seq_length=1)
    sizes = GlobalBatchSizes(ramp)
    assert [sizes.size(i) for i in range(6)] == [1, 1, 2, 3, 3, 3]
    assert [sizes.consumed_before(i) for i in range(6)] == [0, 1, 2, 4, 7, 10]
    # Megatron-LM (before 532ad926b4): ramp iterations while consumed <= 4 (4, reaching 7),
    # then whole batches of 3: (12 - 7) // 3 = 1.
    assert megatron_train_iters(ramp, 12) == 5
    # d98e8a64's step schedule: until 12 samples are consumed (the last batch overshoots).
    assert megatron_train_iters(_step("0:1 2:2 4:3"), 12) == 6
    assert megatron_train_iters(_step("0:1 2:2 4:3"), 13) == 6
    # The documented example: 16 -> 1024 by 8 over 300000 samples (126 increments).
    big = GlobalBatchSizes(BatchSizeArgs(rampup_batch_size=(16, 8, 300000),
                                         global_batch_size=1024, seq_length=1))
    assert big.size(0) == 16 and big.size(100) == 16 and big.size(1000) > 16
    assert big.settled_iteration(10 ** 6) is not None


def _cfg(*extra, drop=()):
    flags = list(TINY_FLAGS)
    for name in drop:
        flags = drop_flag(flags, name)
    return parse_args(flags + list(extra))


def test_flags_give_the_schedule_its_iterations_and_lr_samples():
    cfg = _cfg("--step-batch-size-schedule", "0:2 0.384K:4 1.152K:6", "--lr-warmup-fraction",
               "0.1", "--lr-decay-iters", "6", "--train-iters", "6",
               drop=["--global-batch-size"])
    b = cfg.run.batch_sizes
    assert cfg.global_batch_size == 6 and b.schedule() == ((0, 2), (4, 4), (12, 6))
    assert (b.lr_decay_samples, b.wd_incr_samples) == (36, 36)
    assert b.lr_warmup_samples == pytest.approx(3.6) and cfg.optim.train_iters == 6
    assert any("2 from 0, 4 from 4, 6 from 12" in note for note in cfg.run.notes)
    # Megatron's own script repeats the last size as --global-batch-size: accepted.
    assert _cfg("--global-batch-size", "6", "--step-batch-size-schedule", "0:2 96:6"
                ).global_batch_size == 6
    ramp = _cfg("--rampup-batch-size", "2", "2", "8", "--train-samples", "30",
                "--lr-warmup-samples", "3", drop=["--train-iters"])
    r = ramp.run.batch_sizes
    assert ramp.optim.train_iters == 6 and ramp.global_batch_size == 6
    assert (r.lr_warmup_samples, r.lr_decay_samples, r.wd_incr_samples) == (3, 30, 30)
    assert any("deprecated in megatron-lm" in note.lower() for note in ramp.run.notes)
    assert _cfg().run.batch_sizes is None  # a constant global batch: nothing changes


@pytest.mark.parametrize("extra,drop,needle", [
    (["--step-batch-size-schedule", "0:2 96:4"], [],
     "Cannot specify both --step-batch-size-schedule and --global-batch-size"),
    (["--step-batch-size-schedule", "0:2 96:4", "--rampup-batch-size", "2", "2", "8"], [],
     "give one"),
    (["--step-batch-size-schedule", "96:4"], ["--global-batch-size"],
     "first schedule entry must have threshold 0, got 1"),
    (["--step-batch-size-schedule", "0:4 96:2"], ["--global-batch-size"],
     "batch size 2 after 4"),
    (["--step-batch-size-schedule", "0:2", "--decrease-batch-size-if-needed"],
     ["--global-batch-size"], "--decrease-batch-size-if-needed: drop"),
    (["--rampup-batch-size", "2", "2", "8"], [],
     "expected no batch-size rampup for iteration-based training"),
    (["--rampup-batch-size", "2", "3", "8", "--train-samples", "30"], ["--train-iters"],
     "global batch size interval (4) to be divisible by global batch size increment (3)"),
    (["--rampup-batch-size", "8", "2", "8", "--train-samples", "30"], ["--train-iters"],
     "greater than or equal to start batch size, got 6 and 8"),
    (["--rampup-batch-size", "6", "2", "8", "--train-samples", "30"], ["--train-iters"],
     "nothing to ramp"),
    (["--rampup-batch-size", "2", "2", "0", "--train-samples", "30"], ["--train-iters"],
     "ramp-up samples 0: nothing to ramp"),
    (["--rampup-batch-size", "2", "2", "8", "--train-samples", "30"],
     ["--train-iters", "--global-batch-size"], "needs --global-batch-size"),
    ([], ["--global-batch-size"], "give --global-batch-size N"),
    (["--step-batch-size-schedule", "0:2 96:4", "--skrull-lookahead", "2"],
     ["--global-batch-size"], "--skrull-lookahead 2 with a batch-size schedule"),
])
def test_bad_schedules_are_one_line_naming_the_fix(extra, drop, needle):
    with pytest.raises(ConfigError) as info:
        _cfg(*extra, drop=drop)
    assert any(needle in p for p in info.value.problems), info.value.problems


def _walk(num_samples, sizes, perm, iters):
    """Independent statement of the scheduled sampler: consecutive slices of each epoch's
    permutation, a batch that would cross the end starts the next epoch."""
    epoch, offset, out = 0, 0, []
    for it in range(iters):
        size = sizes.size(it)
        if offset + size > num_samples:
            epoch, offset = epoch + 1, 0
        out.append([int(i) for i in perm(epoch)[offset:offset + size]])
        offset += size
    return out


def test_scheduled_sampler_reduces_to_the_constant_one_and_walks_epochs():
    constant = GlobalBatchSampler(23, 5, seed=3)
    same = ScheduledBatchSampler(23, GlobalBatchSizes(_step("0:5")), seed=3)
    assert [same.batch(i) for i in range(20)] == [constant.batch(i) for i in range(20)]
    sizes = GlobalBatchSizes(_step("0:2 7:3 20:5"))
    sampler = ScheduledBatchSampler(23, sizes, seed=3)
    expected = _walk(23, sizes, constant.epoch_permutation, 40)
    for it in itertools.chain(range(40), (37, 2, 15)):  # the closed form past the ramp, too
        assert sampler.batch(it) == expected[it]
        assert len(set(sampler.batch(it))) == sizes.size(it)
    with pytest.raises(ValueError, match="fewer than the largest global batch 5"):
        ScheduledBatchSampler(4, sizes, seed=3)


def test_scheduled_sampler_resumes_exactly_and_refuses_another_schedule():
    sizes = GlobalBatchSizes(_step("0:2 7:3 20:5"))
    run = ScheduledBatchSampler(23, sizes, seed=3)
    for _ in range(6):
        next(run)
    state = run.state_dict()
    assert state["consumed_samples"] == sizes.consumed_before(6) == 14
    resumed = ScheduledBatchSampler(23, GlobalBatchSizes(_step("0:2 7:3 20:5")), seed=3)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(8)] == [next(run) for _ in range(8)]
    other = ScheduledBatchSampler(23, GlobalBatchSizes(_step("0:2 7:4 20:5")), seed=3)
    for target, saved in ((other, state), (GlobalBatchSampler(23, 5, seed=3), state),
                          (resumed, GlobalBatchSampler(23, 5, seed=3).state_dict())):
        with pytest.raises(ValueError, match="resume with the batch-size flags"):
            target.load_state_dict(saved)


def test_scheduled_blend_takes_consecutive_blend_positions():
    sizes_of, weights = [7, 11, 5], [0.2, 0.5, 0.3]
    constant = BlendedBatchSampler(sizes_of, weights, 4, seed=1)
    same = ScheduledBlendedBatchSampler(sizes_of, weights, GlobalBatchSizes(_step("0:4")), 1)
    assert [same.batch(i) for i in range(12)] == [constant.batch(i) for i in range(12)]
    sizes = GlobalBatchSizes(_step("0:1 3:2 9:4"))
    ramp = ScheduledBlendedBatchSampler(sizes_of, weights, sizes, seed=1, names=["a", "b", "c"])
    stream = [BlendedBatchSampler(sizes_of, weights, 1, seed=1).batch(i)[0] for i in range(60)]
    drawn = list(itertools.chain.from_iterable(next(ramp) for _ in range(14)))
    assert drawn == stream[:sizes.consumed_before(14)]
    counts = dict(ramp.consumed_per_dataset())
    assert sum(counts.values()) == ramp.consumed_samples == sizes.consumed_before(14)
    resumed = ScheduledBlendedBatchSampler(sizes_of, weights, sizes, seed=1)
    resumed.load_state_dict(ramp.state_dict())
    assert np.array_equal(next(resumed), next(ramp))
