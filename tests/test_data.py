"""SFTDataset (reading, causal-LM view, validation errors) and GlobalBatchSampler."""
from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from megatron.skrull import corpus
from megatron.skrull.data import (DatasetFormatError, GlobalBatchSampler, SFTDataset,
                                 load_sft_dataset)
from megatron.skrull.preprocess import (dataset_paths, preprocess, record_to_messages,
                                        tokenize_conversation)
from megatron.skrull.tokenizer import ByteLevelTokenizer


def synthetic_records(n, seed=0, max_tokens=1024):
    config = corpus.CorpusConfig(num_samples=n, seed=seed, max_tokens=max_tokens)
    return [(f"s:{i}", r) for i, r in enumerate(corpus.generate_records(config))]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A 60-sample synthetic dataset plus the records it came from."""
    root = tmp_path_factory.mktemp("ds")
    records = synthetic_records(60)
    preprocess(records, str(root / "ds"), ByteLevelTokenizer(), seq_length=1024)
    return str(root / "ds"), records


def copy_dataset(src_prefix, dst_dir):
    dst_prefix = os.path.join(dst_dir, "copy")
    for key, path in dataset_paths(src_prefix).items():
        shutil.copy(path, dataset_paths(dst_prefix)[key])
    return dst_prefix


def test_round_trip_tokens_masks_and_example(built):
    prefix, records = built
    ds = SFTDataset(prefix, verify_tokens=True)
    tok = ByteLevelTokenizer()
    assert len(ds) == ds.num_samples == len(records)
    assert ds.lengths.dtype == np.int64 and ds.lengths.shape == (len(records),)
    for i, (where, rec) in enumerate(records):
        want_tokens, want_mask = tokenize_conversation(tok, record_to_messages(rec, where))
        tokens, mask = ds[i]
        assert tokens.dtype == torch.int64 and mask.dtype == torch.float32
        assert tokens.tolist() == want_tokens.tolist()
        assert mask.tolist() == want_mask.tolist()
        ex = ds.get_example(i)
        L = len(want_tokens) - 1
        assert ds.lengths[i] == L
        assert ex.input_ids.shape == ex.labels.shape == ex.loss_mask.shape == (L,)
        assert ex.input_ids.tolist() == want_tokens[:-1].tolist()
        assert ex.labels.tolist() == want_tokens[1:].tolist()
        assert ex.loss_mask.tolist() == want_mask[1:].tolist()
    assert ds.max_length == int(ds.lengths.max())
    assert ds[-1][0].tolist() == ds[len(ds) - 1][0].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError):  # lengths are read-only: the scheduler cannot corrupt them
        ds.lengths[0] = 5


def test_pickle_round_trip(built):
    prefix, _ = built
    ds = SFTDataset(prefix)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[3][0].tolist() == ds[3][0].tolist()
    assert np.array_equal(clone.lengths, ds.lengths)


def test_check_tokenizer(built, tmp_path):
    prefix, _ = built
    ds = SFTDataset(prefix)
    ds.check_tokenizer(ByteLevelTokenizer(), seq_length=1024)
    with pytest.raises(DatasetFormatError, match="--seq-length 10"):
        ds.check_tokenizer(ByteLevelTokenizer(), seq_length=10)
    from data_helpers import SKRULL_SPECIALS, make_hf_tokenizer
    from megatron.skrull.tokenizer import HFTokenizer

    hf = HFTokenizer(make_hf_tokenizer(str(tmp_path / "t.json"), SKRULL_SPECIALS))
    with pytest.raises(DatasetFormatError, match="differs in type, vocab_size"):
        ds.check_tokenizer(hf)


@pytest.mark.parametrize("key", ["tokens_bin", "tokens_idx", "mask_bin", "mask_idx", "meta"])
def test_missing_file(built, tmp_path, key):
    prefix = copy_dataset(built[0], tmp_path)
    path = dataset_paths(prefix)[key]
    os.remove(path)
    with pytest.raises(DatasetFormatError, match="missing") as exc:
        SFTDataset(prefix)
    assert path in str(exc.value) and "preprocess_sft.py" in str(exc.value)


@pytest.mark.parametrize("raw", ["chat.jsonl", "snapshot"])
def test_raw_chat_data_as_data_path_names_preprocessing(built, tmp_path, raw):
    """--data-path at chat data itself (a file, or a datasets directory, as Megatron-LM
    dev's --use-varlen-dataset reads it): the message says how to get a prefix."""
    path = tmp_path / raw
    if raw.endswith(".jsonl"):
        path.write_text('{"messages": []}\n')
    else:
        path.mkdir()
    with pytest.raises(DatasetFormatError, match="raw data, not a preprocessed dataset "
                                                 "prefix") as exc:
        SFTDataset(str(path))
    assert f"--input {path}" in str(exc.value) and "--data-path PREFIX" in str(exc.value)
    with pytest.raises(DatasetFormatError, match="no preprocessed dataset there"):
        SFTDataset(str(tmp_path / "nvidia" / "Nemotron-SFT-Math-v3"))  # a hub id, say
    # a real prefix whose files sit beside a same-named directory still opens
    os.makedirs(tmp_path / "ok")
    prefix = copy_dataset(built[0], tmp_path / "ok")
    os.makedirs(prefix)
    assert len(SFTDataset(prefix)) > 0


def _truncate(path, nbytes):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - nbytes)


def _overwrite(path, offset, data):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


CORRUPTIONS = {
    "idx_truncated": ("tokens_idx", lambda p: _truncate(p, 8), "bytes, expected"),
    "idx_bad_magic": ("mask_idx", lambda p: _overwrite(p, 0, b"XXXX"), "bad header"),
    "idx_empty": ("tokens_idx", lambda p: _truncate(p, os.path.getsize(p)), "bad header"),
    "idx_bad_version": ("tokens_idx", lambda p: _overwrite(p, 9, b"\x02"), "version 2"),
    "idx_bad_dtype": ("tokens_idx", lambda p: _overwrite(p, 17, b"\x63"), "dtype code 99"),
    "idx_bad_length": ("tokens_idx", lambda p: _overwrite(p, 34, b"\x07\x00\x00\x00"),
                       "lengths and pointers disagree"),
    "bin_truncated": ("tokens_bin", lambda p: _truncate(p, 2), "but .* indexes"),
    "mask_bin_extra": ("mask_bin", lambda p: open(p, "ab").write(b"\x01"), "but .* indexes"),
    "meta_not_json": ("meta", lambda p: open(p, "w").write("{oops"), "not valid JSON"),
    "meta_version": ("meta", lambda p: open(p, "w").write('{"format_version": 9}'),
                     "format_version"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_files(built, tmp_path, name):
    key, corrupt, message = CORRUPTIONS[name]
    prefix = copy_dataset(built[0], tmp_path)
    path = dataset_paths(prefix)[key]
    corrupt(path)
    with pytest.raises(DatasetFormatError, match=message) as exc:
        SFTDataset(prefix)
    assert path in str(exc.value) and "re-run tools/preprocess_sft.py" in str(exc.value)


def test_mismatched_mask_and_metadata(built, tmp_path):
    prefix = copy_dataset(built[0], tmp_path)
    other = str(tmp_path / "other")
    preprocess(synthetic_records(60, seed=99), other, ByteLevelTokenizer(), seq_length=1024)
    for key in ("mask_bin", "mask_idx"):  # a loss mask from a different run
        shutil.copy(dataset_paths(other)[key], dataset_paths(prefix)[key])
    with pytest.raises(DatasetFormatError, match="loss-mask lengths do not match"):
        SFTDataset(prefix)
    prefix = copy_dataset(built[0], tmp_path)
    meta_path = dataset_paths(prefix)["meta"]
    meta = json.load(open(meta_path))
    meta["num_samples"] = 61
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(DatasetFormatError, match="num_samples 61 but the index holds 60"):
        SFTDataset(prefix)
    meta["num_samples"], meta["tokenizer"]["vocab_size"] = 60, 200
    json.dump(meta, open(meta_path, "w"))
    SFTDataset(prefix)  # only the full scan sees ids >= vocab_size
    with pytest.raises(DatasetFormatError, match=r"outside the dataset's vocabulary \[0, 200\)"):
        SFTDataset(prefix, verify_tokens=True)


def test_sampler_epochs_and_determinism():
    n, gbs = 23, 5
    s = GlobalBatchSampler(n, gbs, seed=3)
    assert s.batches_per_epoch == 4
    batches = [next(s) for _ in range(12)]
    assert batches == [GlobalBatchSampler(n, gbs, seed=3).batch(i) for i in range(12)]
    for epoch in range(3):
        flat = sum(batches[4 * epoch:4 * epoch + 4], [])
        assert len(flat) == len(set(flat)) == 20  # distinct; leftover of 3 dropped
        assert flat == s.epoch_permutation(epoch)[:20].tolist()
        assert sorted(s.epoch_permutation(epoch).tolist()) == list(range(n))
    assert batches[0:4] != batches[4:8]  # reshuffled per epoch
    assert s.iteration == 12 and s.epoch == 3 and s.consumed_samples == 60
    assert GlobalBatchSampler(n, gbs, seed=4).batch(0) != batches[0]
    # Seeds key (seed, epoch) pairs: seed 0 epoch 1 is not seed 1 epoch 0.
    assert GlobalBatchSampler(n, gbs, seed=0).batch(4) != GlobalBatchSampler(n, gbs, 1).batch(0)
    ordered = GlobalBatchSampler(n, gbs, seed=3, shuffle=False)
    assert [ordered.batch(i) for i in (0, 4)] == [[0, 1, 2, 3, 4]] * 2


def test_sampler_resume_equivalence():
    ref = GlobalBatchSampler(50, 8, seed=11)
    full = [next(ref) for _ in range(20)]
    run = GlobalBatchSampler(50, 8, seed=11)
    for _ in range(9):
        next(run)
    state = pickle.loads(pickle.dumps(run.state_dict()))  # as a checkpoint would store it
    assert state["iteration"] == 9 and state["consumed_samples"] == 72
    resumed = GlobalBatchSampler(50, 8, seed=11)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(11)] == full[9:]
    started = GlobalBatchSampler(50, 8, seed=11, start_iteration=9)
    assert list(next(started) for _ in range(11)) == full[9:]
    by_samples = GlobalBatchSampler(50, 8, seed=11)
    by_samples.load_state_dict({"consumed_samples": 72})
    assert next(by_samples) == full[9]


def test_sampler_errors():
    with pytest.raises(ValueError, match="fewer than --global-batch-size 8"):
        GlobalBatchSampler(5, 8, seed=0)
    with pytest.raises(ValueError, match="--global-batch-size must be >= 1"):
        GlobalBatchSampler(5, 0, seed=0)
    with pytest.raises(ValueError, match="start_iteration"):
        GlobalBatchSampler(5, 2, seed=0, start_iteration=-1)
    s = GlobalBatchSampler(50, 8, seed=11)
    for key, value in (("seed", 12), ("global_batch_size", 4), ("num_samples", 49)):
        state = s.state_dict()
        state[key] = value
        with pytest.raises(ValueError, match=f"{key}={value}"):
            s.load_state_dict(state)
    with pytest.raises(ValueError, match="not a multiple"):
        s.load_state_dict({"consumed_samples": 12})


def test_load_sft_dataset(built):
    prefix, records = built
    ds = load_sft_dataset([prefix], tokenizer=ByteLevelTokenizer(), seq_length=1024)
    assert len(ds) == len(records)
    assert len(load_sft_dataset(prefix)) == len(records)
    with pytest.raises(ValueError, match="exactly one dataset prefix"):
        load_sft_dataset(["0.5", prefix, "0.5", prefix])
    with pytest.raises(ValueError, match="exactly one dataset prefix"):
        load_sft_dataset([])
    with pytest.raises(DatasetFormatError, match="--seq-length 100"):
        load_sft_dataset(prefix, seq_length=100)
