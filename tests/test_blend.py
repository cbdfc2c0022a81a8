"""Weighted blends: Megatron's --data-path W1 P1 W2 P2 syntax, the blend sampler (proportions,
determinism, exact resume), per-split flags, and one launch that trains a blend, logs its
per-dataset counts (log and TensorBoard), validates each dataset, then a resume of it on two
data-parallel ranks."""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from mcore_helpers import TINY_FLAGS, tiny_config
from test_skrull_launcher import _run
from megatron.skrull.blend import (Blend, BlendedBatchSampler, ConcatSource, parse_blend,
                                   run_blends)
from megatron.skrull.data import GlobalBatchSampler
from megatron.skrull.preprocess import main as preprocess_main
from megatron.skrull.samples import SyntheticSFTSource


def test_parse_blend_follows_megatron():
    assert parse_blend(["a"]) == Blend(("a",))
    assert parse_blend(["a", "b"]) == Blend(("a", "b"))  # weights by size
    assert parse_blend(["1", "a", "3", "b"]) == Blend(("a", "b"), (0.25, 0.75))
    assert parse_blend(["0.3", "x/a", "0.7", "x/b"]).weights == pytest.approx((0.3, 0.7))
    for bad, needle in ((["0.3", "a", "b"], "weight-prefix pairs"),
                        (["0.5", "a", "b", "0.5"], "weight-prefix pairs"),
                        (["0", "a", "1", "b"], "positive number"),
                        (["-1", "a", "2", "b"], "positive number"), ([], "got nothing")):
        with pytest.raises(ValueError, match=needle):
            parse_blend(bad)


def greedy_reference(weights, size):
    """Independent statement of Megatron's blending rule: each position goes to the dataset
    furthest behind its weight (first one on ties)."""
    counts, out = np.zeros(len(weights)), []
    for i in range(size):
        d = int(np.argmax(np.asarray(weights) * max(i, 1) - counts))
        out.append(d)
        counts[d] += 1
    return out


def test_sampler_draws_in_proportion_deterministically_and_resumes_exactly():
    sizes, weights, gbs = [7, 50, 13], [0.2, 0.5, 0.3], 10
    sampler = BlendedBatchSampler(sizes, weights, gbs, seed=3, names=["a", "b", "c"])
    batches = [next(sampler) for _ in range(40)]
    offsets = np.cumsum([0] + sizes)
    which = [[int(np.searchsorted(offsets, i, side="right")) - 1 for i in b] for b in batches]
    assert sum(which, []) == greedy_reference(weights, 400)
    for w in which:  # every batch within one sample of its share
        counts = np.bincount(w, minlength=3)
        assert np.all(np.abs(counts - np.asarray(weights) * gbs) <= 1), counts
    assert sampler.consumed_per_dataset() == [("a", 80), ("b", 200), ("c", 120)]
    # Each dataset is a fresh permutation every epoch: its first 7 draws of "a" are distinct.
    drawn_a = [i for b in batches for i in b if i < 7]
    assert sorted(drawn_a[:7]) == list(range(7)) and drawn_a[:7] != drawn_a[7:14]
    # Pure function of the settings; resume from a state is exact; other seed, other order.
    again = BlendedBatchSampler(sizes, weights, gbs, seed=3)
    assert [next(again) for _ in range(40)] == batches
    resumed = BlendedBatchSampler(sizes, weights, gbs, seed=3)
    probe = BlendedBatchSampler(sizes, weights, gbs, seed=3, start_iteration=25)
    resumed.load_state_dict(json.loads(json.dumps(probe.state_dict())))
    assert [next(resumed) for _ in range(15)] == batches[25:]
    other = BlendedBatchSampler(sizes, weights, gbs, seed=4)
    assert [next(other) for _ in range(40)] != batches
    for changed in (BlendedBatchSampler(sizes, [0.3, 0.4, 0.3], gbs, seed=3),
                    BlendedBatchSampler([7, 50, 14], weights, gbs, seed=3),
                    BlendedBatchSampler(sizes, weights, gbs, seed=5)):
        with pytest.raises(ValueError, match="resume with the same --data-path"):
            changed.load_state_dict(probe.state_dict())
    with pytest.raises(ValueError, match="weighted blend"):
        GlobalBatchSampler(70, gbs, 3).load_state_dict(probe.state_dict())
    with pytest.raises(ValueError, match="without a blend"):
        resumed.load_state_dict(GlobalBatchSampler(70, gbs, 3).state_dict())


def test_concat_source_maps_ids_to_datasets():
    a, b = SyntheticSFTSource(5, 32, seed=1), SyntheticSFTSource(9, 48, seed=2)
    cat = ConcatSource([a, b], ["a", "b"])
    assert len(cat) == 14 and cat.sizes == [5, 9] and cat.weights == pytest.approx([5 / 14,
                                                                                      9 / 14])
    np.testing.assert_array_equal(cat.lengths, np.concatenate([a.lengths, b.lengths]))
    assert cat.locate(7) == (1, 2)
    np.testing.assert_array_equal(cat.sample(7).tokens, b.sample(2).tokens)
    ids = np.array([0, 6, 13, 4])
    assert cat.num_loss_tokens(ids) == (a.num_loss_tokens(np.array([0, 4]))
                                        + b.num_loss_tokens(np.array([1, 8])))


def test_blend_flags(tmp_path):
    from megatron.skrull.arguments import ConfigError

    args = tmp_path / "blend.txt"
    args.write_text("0.25 data/a\n0.75 data/b\n")
    cfg = tiny_config(["--data-args-path", str(args)])
    assert run_blends(cfg.data) == (Blend(("data/a", "data/b"), (0.25, 0.75)), None)
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": "1 data/a 1 data/b", "valid": ["data/va", "data/vb"],
                                 "test": None}))
    cfg = tiny_config(["--per-split-data-args-path", str(split)])
    assert run_blends(cfg.data) == (Blend(("data/a", "data/b"), (0.5, 0.5)),
                                    Blend(("data/va", "data/vb")))
    cfg = tiny_config(["--train-data-path", "2", "a", "1", "b", "--valid-data-path", "v"])
    assert run_blends(cfg.data) == (Blend(("a", "b"), (2 / 3, 1 / 3)), Blend(("v",)))
    for extra, needle in ((["--data-path", "a", "--train-data-path", "b"], "are exclusive"),
                          (["--data-path", "0.5", "a", "b"], "weight-prefix pairs"),
                          (["--train-data-path", "a", "--split", "9,1"], "drop --split"),
                          (["--per-split-data-args-path", "x", "--valid-data-path", "v"],
                           "drop --valid-data-path")):
        with pytest.raises(ConfigError, match=needle):
            tiny_config(extra)


@pytest.mark.multiprocess
def test_a_weighted_blend_trains_reports_counts_validates_each_dataset_and_resumes(tmp_path):
    prefixes = []
    for name, seed, n in (("chat", 1, 60), ("code", 2, 40)):
        prefixes.append(str(tmp_path / name))
        assert preprocess_main(["--synthetic", str(n), "--seed", str(seed), "--seq-length",
                                "96", "--synthetic-max-tokens", "97", "--output-prefix",
                                prefixes[-1]]) == 0
    ckpt = str(tmp_path / "ckpt")
    flags = TINY_FLAGS + [  # (a later --global-batch-size wins)
        "--global-batch-size", "8", "--data-path", "0.25", prefixes[0], "0.75", prefixes[1],
        "--split", "80,20", "--eval-iters", "1", "--save", ckpt, "--save-interval", "3",
        "--lr-decay-style", "constant", "--tensorboard-dir", str(tmp_path / "tb")]
    out = _run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *flags,
                "--train-iters", "3"], timeout=300)
    assert "training blend of 2 datasets (weight, size): chat 0.250 (48 samples), " \
           "code 0.750 (32 samples)" in out, out
    lines = re.findall(r"iteration +(\d+)/.*consumed samples per dataset: chat (\d+) "
                       r"\(([\d.]+)%\), code (\d+)", out)
    assert [(int(i), int(a), int(b)) for i, a, _, b in lines] == [
        (1, 2, 6), (2, 4, 12), (3, 6, 18)], out
    assert re.search(r"validation-chat loss at iteration 3 on validation set \| lm loss", out)
    assert re.search(r"validation-code loss at iteration 3 on validation set \| lm loss", out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.value for e in events.Scalars("consumed samples code")] == [6, 12, 18]
    assert "lm loss validation-chat" in events.Tags()["scalars"]
    # Resumed on two data-parallel ranks: both draw the same batches (the plans' checksum
    # is compared every iteration) and the blend goes on where the checkpoint left it.
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    resumed = _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m",
                    "megatron.skrull.pretrain_gpt", *flags, "--train-iters", "5", "--load",
                    ckpt, "--override-opt_param-scheduler"], timeout=300)
    assert "starting at iteration 3" in resumed and "DP 2 x CP 1" in resumed
    assert re.search(r"iteration +5/.*consumed samples per dataset: chat 10 \(25\.0%\), "
                     r"code 30 \(75\.0%\)", resumed), resumed
