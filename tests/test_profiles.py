"""Length profiles, the global-batch sampler and the lengths readers."""
import json
import math

import numpy as np
import pytest

from skrull_ext.planner.lengths_io import read_lengths, read_megatron_idx_lengths
from skrull_ext.planner.profiles import (LengthOverflowError, load_profile, profile_from_file,
                                 profile_from_lengths, profile_names, sample_global_batches)

CUMULATIVE = ("wikipedia", "lmsyschat1m", "chatqa2-long-sft")
N = 400_000


def test_bundled_profiles_are_listed_with_sources():
    assert set(profile_names()) == set(CUMULATIVE) | {"llama3-sft"}
    for name in profile_names():
        prof = load_profile(name)
        assert "arXiv" in prof.source
        assert prof.min_length == 16


@pytest.mark.parametrize("name", CUMULATIVE)
def test_sampler_matches_published_cumulative_shares(name):
    prof = load_profile(name)
    assert prof.published, "cumulative profiles keep their published points"
    draws = prof.sample(N, np.random.default_rng(123))
    assert draws.dtype == np.int64
    assert draws.min() >= prof.min_length and draws.max() <= prof.max_length
    for threshold, share in prof.published:
        # The CDF passes exactly through every published point...
        assert prof.cdf(threshold) == pytest.approx(share, abs=1e-12)
        # ...and the empirical share of draws below it matches within 5 sigma.
        emp = float(np.mean(draws < threshold))
        sigma = math.sqrt(max(share * (1 - share), 1e-6) / N)
        assert abs(emp - share) <= 5 * sigma + 1e-5, (threshold, emp, share)


def test_profile_maxima_are_the_published_longest():
    k = 1024
    assert load_profile("wikipedia").max_length == 78 * k
    assert load_profile("lmsyschat1m").max_length == 1643 * k
    assert load_profile("chatqa2-long-sft").max_length == 99 * k


def test_llama3_mixture_matches_published_shares_and_means():
    prof = load_profile("llama3-sft")
    (_, f_short_end), (long_start, f_long_start) = prof.points[1], prof.points[2]
    assert f_short_end == pytest.approx(0.9989) and f_long_start == pytest.approx(0.9989)
    assert prof.max_length == 128 * 1024
    expected_mean = 0.9989 * 0.8 * 1024 + 0.0011 * 38 * 1024
    assert prof.mean() == pytest.approx(expected_mean, rel=1e-6)
    draws = prof.sample(2_000_000, np.random.default_rng(7))
    long = draws >= long_start
    assert long.mean() == pytest.approx(0.0011, abs=5 * math.sqrt(0.0011 / 2e6))
    assert draws[~long].mean() == pytest.approx(0.8 * 1024, rel=0.01)
    assert draws[long].mean() == pytest.approx(38 * 1024, rel=0.08)


def test_sampler_is_seeded():
    prof = load_profile("chatqa2-long-sft")
    a = sample_global_batches(prof, num_batches=3, global_batch_size=50, seed=5)
    b = sample_global_batches(prof, num_batches=3, global_batch_size=50, seed=5)
    c = sample_global_batches(prof, num_batches=3, global_batch_size=50, seed=6)
    assert len(a.batches) == 3 and all(x.shape == (50,) for x in a.batches)
    assert all(np.array_equal(x, y) for x, y in zip(a.batches, b.batches))
    assert not all(np.array_equal(x, y) for x, y in zip(a.batches, c.batches))


def test_overflow_policies():
    prof = load_profile("chatqa2-long-sft")
    limit = 20_000
    expected = 1.0 - float(prof.cdf(limit + 1))
    trunc = sample_global_batches(prof, num_batches=20, global_batch_size=100, seed=1,
                                  max_length=limit, overflow="truncate")
    allv = np.concatenate(trunc.batches)
    assert allv.max() == limit
    assert 0 < trunc.overflow <= int(np.sum(allv == limit))
    assert trunc.overflow / 2000 == pytest.approx(expected, abs=0.05)
    redraw = sample_global_batches(prof, num_batches=20, global_batch_size=100, seed=1,
                                   max_length=limit, overflow="redraw")
    assert max(int(b.max()) for b in redraw.batches) <= limit
    assert redraw.overflow > 0 and redraw.policy == "redraw"
    # Redrawn values follow the profile below the limit: some land well below it.
    assert np.mean(np.concatenate(redraw.batches) == limit) < 0.01
    with pytest.raises(LengthOverflowError, match="longer than the longest that fits"):
        sample_global_batches(prof, num_batches=2, global_batch_size=100, seed=1,
                              max_length=limit, overflow="error")
    with pytest.raises(ValueError, match="overflow must be one of"):
        sample_global_batches(prof, num_batches=1, global_batch_size=1, overflow="drop")


def test_scaled_profile_moves_the_points():
    prof = load_profile("wikipedia").scaled(0.1)
    assert prof.cdf(102.4) == pytest.approx(0.8788)
    assert prof.max_length == int(78 * 1024 * 0.1)
    assert prof.min_length == 1  # 16 * 0.1 floored at one token
    with pytest.raises(ValueError, match="--scale"):
        load_profile("wikipedia").scaled(0.0)


def test_empirical_profile_samples_its_own_values():
    prof = profile_from_lengths([5, 7, 7, 100], name="mine")
    draws = prof.sample(1000, np.random.default_rng(0))
    assert set(draws.tolist()) <= {5, 7, 100}
    assert prof.cdf(8) == pytest.approx(0.75)
    assert prof.scaled(2).max_length == 200
    assert set(prof.sample(50, np.random.default_rng(0), below=8).tolist()) <= {5, 7}


def test_unknown_profile_names_the_choices():
    with pytest.raises(ValueError, match="wikipedia"):
        load_profile("nope")


def test_read_lengths_formats(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([3, 10, 4000]))
    np.save(tmp_path / "b.npy", np.array([3, 10, 4000], dtype=np.int32))
    (tmp_path / "c.txt").write_text("# lengths\n3\n\n10\n4000\n")
    for name in ("a.json", "b.npy", "c.txt"):
        arr = read_lengths(str(tmp_path / name))
        assert arr.dtype == np.int64 and arr.tolist() == [3, 10, 4000]
    assert profile_from_file(str(tmp_path / "c.txt")).max_length == 4000


@pytest.mark.parametrize("name,content,match", [
    ("bad.txt", "12\n7\nabc\n", r"bad.txt: line 3: 'abc' is not an integer"),
    ("neg.txt", "12\n\n0\n", r"neg.txt: line 3: length 0 is < 1"),
    ("bad.json", "[1, 2.5]", r"bad.json: element 1 is 2.5"),
    ("obj.json", '{"a": 1}', r"obj.json: expected a JSON list"),
    ("broken.json", "[1, 2", r"broken.json: not valid JSON"),
    ("empty.txt", "\n# nothing\n", r"empty.txt: contains no lengths"),
])
def test_read_lengths_errors_name_file_and_line(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        read_lengths(str(tmp_path / name))


def test_read_lengths_npy_and_missing_errors(tmp_path):
    np.save(tmp_path / "f.npy", np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="integer array"):
        read_lengths(str(tmp_path / "f.npy"))
    np.save(tmp_path / "m.npy", np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="1-D"):
        read_lengths(str(tmp_path / "m.npy"))
    with pytest.raises(ValueError, match="no such lengths file"):
        read_lengths(str(tmp_path / "missing.txt"))


def test_megatron_idx_reader_matches_megatron(tmp_path):
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix = str(tmp_path / "data")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    lengths = [5, 1, 300, 17, 42]
    for s in lengths:
        builder.add_item(torch.arange(s, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    assert read_megatron_idx_lengths(prefix).tolist() == lengths
    assert read_megatron_idx_lengths(prefix + ".idx").tolist() == lengths
    ours = read_megatron_idx_lengths(prefix)
    dataset = indexed.IndexedDataset(prefix)  # keep alive: its arrays view its mmap
    assert ours.tolist() == dataset.sequence_lengths.tolist()
    del dataset
    (tmp_path / "junk.idx").write_bytes(b"NOTANIDX" * 8)
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX"):
        read_megatron_idx_lengths(str(tmp_path / "junk"))
    raw = (tmp_path / "data.idx").read_bytes()
    (tmp_path / "cut.idx").write_bytes(raw[:40])
    with pytest.raises(ValueError, match="truncated"):
        read_megatron_idx_lengths(str(tmp_path / "cut"))
