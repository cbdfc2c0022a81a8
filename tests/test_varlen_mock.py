"""Megatron-LM dev's --use-varlen-dataset --mock-data lengths (megatron/skrull/varlen_mock.py)
driving our synthetic task, and the flags' one-line errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron.skrull import varlen_mock
from megatron.skrull.data import build_sample_sources
from megatron.skrull.errors import ConfigError
from mcore_helpers import tiny_config

# The length mix of Megatron-LM's dynamic-CP example (examples/dynamic_context_parallel).
EXAMPLE = {"mode": "distribution", "type": "lognormal", "format": "thd", "min_seq_len": 128,
           "max_seq_len": 8192, "mean_seq_len": 1024, "lognormal_sigma": 1.5}


def test_distribution_mode_is_megatrons_draw():
    """MockSFTLowLevelDataset: np.random.seed(0), then 1M lognormal draws with the global
    RNG, clipped and truncated to int."""
    got = varlen_mock.megatron_lengths(EXAMPLE)
    np.random.seed(0)
    want = np.random.lognormal(math.log(1024) - 1.5 ** 2 / 2, 1.5, 1_000_000)
    want = np.clip(want, 128, 8192).astype(int)
    np.testing.assert_array_equal(got, want)
    # Megatron's default without the flag: [S / 2, S], mean 3 S / 4, sigma 1.1
    default = varlen_mock.read_config(None, 4096)
    assert (default["min_seq_len"], default["max_seq_len"], default["mean_seq_len"],
            default["lognormal_sigma"]) == (2048, 4096, 3072, 1.1)


def test_file_mode_skips_the_header_row_and_wraps(tmp_path):
    csv = tmp_path / "lengths.csv"
    csv.write_text("length\n100\n7\n3000\n")
    config = varlen_mock.read_config(json.dumps({"mode": "file", "path": str(csv)}), 64)
    assert varlen_mock.megatron_lengths(config).tolist() == [100, 7, 3000]
    # the shift by one position, then [4, --seq-length]; sample i takes length i % 3
    assert varlen_mock.sample_positions(config, 5, 512).tolist() == [99, 6, 512, 99, 6]
    saved = tmp_path / "config.json"  # the flag also takes a file holding the JSON
    saved.write_text(json.dumps(EXAMPLE))
    assert varlen_mock.read_config(str(saved), 64) == EXAMPLE


def test_the_launcher_trains_on_megatrons_mock_lengths():
    cfg = tiny_config(["--use-varlen-dataset", "--seq-length", "8192",
                       "--varlen-mock-dataset-config-json", json.dumps(EXAMPLE),
                       "--mock-num-samples", "64", "--skrull-bucket-size", "8192"])
    source = build_sample_sources(cfg).train
    np.testing.assert_array_equal(source.lengths, varlen_mock.megatron_lengths(EXAMPLE)[:64] - 1)
    sample = source.sample(int(np.argmax(source.lengths)))
    assert len(sample.tokens) == source.lengths.max()
    # without --use-varlen-dataset the mock keeps its own lengths
    plain = build_sample_sources(tiny_config(["--mock-num-samples", "64"])).train
    assert plain.lengths.max() <= 96  # TINY_FLAGS: --seq-length 96


@pytest.mark.parametrize("extra,needle", [
    (["--varlen-mock-dataset-config-json", "{}"], "add them"),
    (["--use-varlen-dataset", "--varlen-mock-dataset-config-json", "{nope"],
     "not valid JSON"),
    (["--use-varlen-dataset", "--varlen-mock-dataset-config-json", "/no/such.json"],
     "neither a JSON object nor a file"),
    (["--use-varlen-dataset", "--varlen-mock-dataset-config-json",
      '{"mode": "verification", "data_path": "x"}'], "use --data-path"),
    (["--use-varlen-dataset", "--varlen-mock-dataset-config-json",
      '{"mode": "distribution", "type": "lognormal", "min_seq_len": 1}'],
     "needs min_seq_len, max_seq_len"),
    (["--use-varlen-dataset", "--varlen-mock-dataset-config-json",
      '{"mode": "file", "path": "/no/lengths.csv"}'], "CSV of sequence lengths"),
    (["--varlen-sbhd-validation"], "SBHD reference mode"),
])
def test_bad_varlen_flags_give_one_line(extra, needle):
    with pytest.raises(ConfigError) as info:
        tiny_config(extra)
    assert len(info.value.problems) == 1 and needle in info.value.problems[0], \
        info.value.problems
