"""Every user entry point against the bad inputs a user meets (docs/troubleshooting.md).

Each row asserts the contract of :mod:`megatron.skrull.errors`: exit status 2 (bad input)
or 1 (failure), a few stderr lines carrying ``error:`` and the fix, no Python traceback,
and nothing written before lost or half-written.  Entry points that take ``argv`` are
called in-process (a subprocess costs 2-5 s of torch imports); the torchrun rows share one
launch each.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil

import numpy as np
import pytest

from megatron.skrull import preprocess as pp
from megatron.skrull.data import DatasetFormatError, load_sft_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_reported(code, err, expect_code, *needles, max_lines=3):
    """One error report: status, few lines, ``error:``, the needles, no traceback."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == expect_code, err
    assert 1 <= len(lines) <= max_lines, err
    assert any("error:" in ln for ln in lines), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small preprocessed dataset (byte-level tokenizer)."""
    prefix = str(tmp_path_factory.mktemp("data") / "synth")
    assert pp.main(["--synthetic", "30", "--seed", "2", "--seq-length", "200",
                    "--output-prefix", prefix]) == 0
    return prefix


def _copy(prefix, dest):
    out = str(dest / "copy")
    for src in pp.dataset_paths(prefix).values():
        shutil.copy(src, out + src[len(prefix):])
    return out


def _snapshot(prefix):
    return {k: open(p, "rb").read() for k, p in pp.dataset_paths(prefix).items()}


# --- tools/preprocess_sft.py ------------------------------------------------------------

PREPROCESS_ROWS = [
    # (argv after --output-prefix, status, needles)
    (["--synthetic", "0"], 2, ["--synthetic must be >= 1"]),
    (["--synthetic", "3", "--seq-length", "-5"], 2, ["--seq-length must be >= 1"]),
    (["--synthetic", "x"], 2, ["invalid int value", "see --help"]),
    (["--input", "MISSING.jsonl"], 2, ["--input", "does not exist"]),
    (["--synthetic", "3", "--tokenizer-type", "HFTokenizer", "--tokenizer-model", "nope.json"],
     2, ["--tokenizer-model", "tokenizer.json"]),
    (["--synthetic", "3", "--save-jsonl", "x.jsonl", "--input", "a.jsonl"], 2,
     ["not allowed with"]),
    (["--input", "BAD.jsonl"], 2, ["BAD.jsonl:2", "malformed JSON"]),
    (["--input", "BAD.jsonl", "--skrull-bucket-size", "8"], 2,
     ["unrecognized arguments: --skrull-bucket-size"]),
]


@pytest.mark.parametrize("argv,status,needles", PREPROCESS_ROWS)
def test_preprocess_bad_input(tmp_path, capsys, argv, status, needles):
    (tmp_path / "BAD.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    argv = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv]
    try:
        code = pp.main(argv + ["--output-prefix", str(tmp_path / "out")])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert_reported(code, capsys.readouterr().err, status, *needles)
    assert sorted(os.listdir(tmp_path)) == ["BAD.jsonl"]  # nothing written, no temp file


class _FullDiskRaw(io.FileIO):
    """A file on a disk with ``room`` bytes left: the OS refuses writes past it (the
    buffered writer on top then fails again when it flushes at close)."""

    room = 3000

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_preprocess_full_disk_keeps_the_old_dataset_and_no_temp_file(tmp_path, capsys,
                                                                       monkeypatch, dataset):
    prefix = _copy(dataset, tmp_path)
    before = _snapshot(prefix)
    builder = pp._import_indexed_dataset().IndexedDatasetBuilder
    real_init = builder.__init__

    def full_disk_init(self, path, dtype=None):
        real_init(self, path, dtype=dtype)
        self.data_file.close()
        self.data_file = io.BufferedWriter(_FullDiskRaw(path, "wb"))

    monkeypatch.setattr(builder, "__init__", full_disk_init)
    code = pp.main(["--synthetic", "30", "--seq-length", "200", "--output-prefix", prefix])
    assert_reported(code, capsys.readouterr().err, 1, "No space left on device",
                    "free space", "nothing was replaced")
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f], os.listdir(tmp_path)
    assert _snapshot(prefix) == before


# --- the dataset as the launcher opens it ---------------------------------------------

def _corrupt(prefix, kind):
    paths = pp.dataset_paths(prefix)
    if kind == "token-out-of-vocab":
        meta = json.load(open(paths["meta"]))
        tokens = np.memmap(paths["tokens_bin"], dtype=meta["token_dtype"], mode="r+")
        tokens[17] = meta["tokenizer"]["vocab_size"] + 3
        tokens.flush()
    elif kind == "truncated-bin":
        os.truncate(paths["tokens_bin"], os.path.getsize(paths["tokens_bin"]) - 7)
    elif kind == "truncated-idx":
        os.truncate(paths["tokens_idx"], 20)
    elif kind == "corrupt-json":
        open(paths["meta"], "w").write('{"format_version": 1,')
    elif kind == "missing-json":
        os.remove(paths["meta"])
    elif kind == "mask-of-another-dataset":
        os.truncate(paths["mask_bin"], 0)


@pytest.mark.parametrize("kind,needle", [
    ("token-out-of-vocab", "outside the dataset's vocabulary"),
    ("truncated-bin", "bytes but"),
    ("truncated-idx", "bad header"),
    ("corrupt-json", "not valid JSON"),
    ("missing-json", "missing"),
    ("mask-of-another-dataset", "_lossmask.bin"),
])
def test_corrupt_dataset_is_one_clear_error_at_load(tmp_path, dataset, kind, needle):
    prefix = _copy(dataset, tmp_path)
    _corrupt(prefix, kind)
    with pytest.raises(DatasetFormatError, match="preprocess_sft.py") as info:
        load_sft_dataset(prefix)
    assert needle in str(info.value) and "\n" not in str(info.value)
