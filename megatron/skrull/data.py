"""SFT dataset reader and the global-batch sampler of the training loop.

:class:`SFTDataset` reads what ``tools/preprocess_sft.py`` writes (docs/data.md): a token
``IndexedDataset`` at ``<prefix>``, a loss-mask ``IndexedDataset`` at ``<prefix>_lossmask``
and ``<prefix>.json`` metadata.  It validates the files up front (sizes, headers, matching
lengths) so a truncated or mismatched dataset fails at start-up with the file named, not
mid-run with a garbled sample.

Causal-LM convention (fixed here, used by everything downstream): a stored sample of S
tokens gives L = S - 1 training positions, ``input_ids = tokens[:-1]``,
``labels = tokens[1:]``, ``loss_mask = mask[1:]`` (the mask of the *label* token).
:attr:`SFTDataset.lengths` reports L, the length the Skrull scheduler packs.
"""
from __future__ import annotations

import json
import os
import struct
import warnings
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from megatron.skrull.batch_size import check_schedule
from megatron.skrull.preprocess import FORMAT_VERSION, LOSSMASK_SUFFIX, dataset_paths
from megatron.skrull.tokenizer import SFTTokenizer

with warnings.catch_warnings():  # megatron.core warns about missing TE/Apex at import
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + doc count 8
_FIX = "re-run tools/preprocess_sft.py to rebuild the dataset"


class DatasetFormatError(ValueError):
    """A preprocessed dataset is incomplete, corrupt or inconsistent."""


def _tokenizer_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys of the tokenizer identity on which two descriptions differ."""
    return [k for k in ("type", "vocab_size", "eod", "pad", "bos") if a.get(k) != b.get(k)]


class SFTExample(NamedTuple):
    """One training sample; every field has shape ``[L]``.

    Attributes:
        input_ids: int64 tokens ``0 .. L-1`` of the stored sample.
        labels: int64 tokens ``1 .. L`` (next-token targets).
        loss_mask: float32, 1.0 where the label is trained.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


class _IdxInfo(NamedTuple):
    dtype: type
    lengths: np.ndarray  # int32 [n] stored tokens per sequence


def _read_idx(idx_path: str, bin_path: str) -> _IdxInfo:
    """Checks one ``.idx``/``.bin`` pair against Megatron's layout; returns dtype and lengths."""
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DatasetFormatError(f"{path}: missing; {_FIX}")
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as fh:
        head = fh.read(_IDX_HEADER_BYTES)
    if len(head) < _IDX_HEADER_BYTES or head[:9] != _IDX_MAGIC:
        raise DatasetFormatError(f"{idx_path}: not a Megatron index file (bad header); {_FIX}")
    version, code, n, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise DatasetFormatError(f"{idx_path}: index version {version} != 1; {_FIX}")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise DatasetFormatError(f"{idx_path}: unknown dtype code {code}; {_FIX}") from None
    expected = _IDX_HEADER_BYTES + n * 4 + n * 8 + docs * 8
    if size != expected:
        raise DatasetFormatError(f"{idx_path}: {size} bytes, expected {expected} for {n} "
                                 f"sequences and {docs} document boundaries; {_FIX}")
    lengths = np.fromfile(idx_path, dtype=np.int32, count=n, offset=_IDX_HEADER_BYTES)
    pointers = np.fromfile(idx_path, dtype=np.int64, count=n,
                           offset=_IDX_HEADER_BYTES + 4 * n)
    doc_idx = np.fromfile(idx_path, dtype=np.int64, count=docs,
                          offset=_IDX_HEADER_BYTES + 12 * n)
    itemsize = np.dtype(dtype).itemsize
    starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * itemsize
    if (lengths < 0).any() or not np.array_equal(pointers, starts[:n]):
        raise DatasetFormatError(f"{idx_path}: sequence lengths and pointers disagree; {_FIX}")
    if docs == 0 or doc_idx[-1] != n:
        raise DatasetFormatError(f"{idx_path}: document index does not end at sequence {n}; "
                                 f"{_FIX}")
    bin_size = os.path.getsize(bin_path)
    if bin_size != int(lengths.sum(dtype=np.int64)) * itemsize:
        raise DatasetFormatError(f"{bin_path}: {bin_size} bytes but {idx_path} indexes "
                                 f"{int(lengths.sum(dtype=np.int64)) * itemsize}; {_FIX}")
    return _IdxInfo(dtype, lengths)


def _refuse_raw_data(prefix: str, paths: dict[str, str]) -> None:
    """A ``--data-path`` naming chat data itself (a file or directory, as Megatron-LM dev's
    ``--use-varlen-dataset`` reads it) rather than a preprocessed prefix: say how to get one."""
    how = ("--output-prefix PREFIX --tokenizer-type HFTokenizer --tokenizer-model MODEL, "
           "docs/data.md), then pass --data-path PREFIX")
    if os.path.exists(prefix) and not os.path.isfile(paths["meta"]):
        raise DatasetFormatError(
            f"{prefix}: raw data, not a preprocessed dataset prefix; tokenize it first "
            f"(python tools/preprocess_sft.py --input {prefix} {how}")
    if not any(os.path.exists(p) for p in paths.values()):
        raise DatasetFormatError(
            f"{prefix}: no preprocessed dataset there (no {prefix}.bin, .idx or .json); "
            "tokenize your chat data (a file or a datasets directory; a hub id once "
            f"downloaded) first (python tools/preprocess_sft.py --input DATA {how}")


def _read_meta(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise DatasetFormatError(f"{path}: missing (written last by preprocessing, so the "
                                 f"dataset is incomplete); {_FIX}")
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"{path}: not valid JSON ({exc}); {_FIX}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise DatasetFormatError(f"{path}: format_version is not {FORMAT_VERSION}; {_FIX}")
    return meta


class SFTDataset(torch.utils.data.Dataset):
    """Preprocessed SFT samples (tokens + loss mask), memory-mapped.

    Args:
        path_prefix: The ``--output-prefix`` given to ``tools/preprocess_sft.py`` (one
            ``--data-path`` entry).
        verify_tokens: Also scan every token for ids outside the stored vocabulary (reads the
            whole ``.bin``; :func:`load_sft_dataset`, the launcher's path, turns it on).

    Raises:
        DatasetFormatError: A file is missing, corrupt, or the token and mask datasets or the
            metadata disagree; the message names the file and the fix.
    """

    def __init__(self, path_prefix: str, *, verify_tokens: bool = False) -> None:
        self.path_prefix = path_prefix
        paths = dataset_paths(path_prefix)
        _refuse_raw_data(path_prefix, paths)
        self.metadata = _read_meta(paths["meta"])
        tok = _read_idx(paths["tokens_idx"], paths["tokens_bin"])
        mask = _read_idx(paths["mask_idx"], paths["mask_bin"])
        if np.dtype(mask.dtype) != np.uint8:
            raise DatasetFormatError(f"{paths['mask_idx']}: loss mask dtype is "
                                     f"{np.dtype(mask.dtype).name}, expected uint8; {_FIX}")
        if not np.array_equal(tok.lengths, mask.lengths):
            raise DatasetFormatError(f"{paths['mask_idx']}: loss-mask lengths do not match "
                                     f"{paths['tokens_idx']}; {_FIX}")
        self._token_dtype = tok.dtype
        n = len(tok.lengths)
        if self.metadata.get("num_samples") != n:
            raise DatasetFormatError(f"{paths['meta']}: num_samples "
                                     f"{self.metadata.get('num_samples')} but the index holds "
                                     f"{n}; {_FIX}")
        if n and tok.lengths.min() < 2:
            raise DatasetFormatError(f"{paths['tokens_idx']}: a sample has fewer than 2 tokens "
                                     f"(no training position); {_FIX}")
        # L = S - 1: the training length the scheduler packs (see module docstring).
        self.lengths: np.ndarray = tok.lengths.astype(np.int64) - 1
        self.lengths.flags.writeable = False
        self._tokens = IndexedDataset(path_prefix)
        self._mask = IndexedDataset(path_prefix + LOSSMASK_SUFFIX)
        if verify_tokens:
            self._verify_tokens()

    def _verify_tokens(self) -> None:
        """Every token id in ``[0, vocab_size)``: a bad id would otherwise surface as an
        ``IndexError`` deep in the embedding, iterations into training.

        Vectorised over the memory-mapped ``.bin`` in chunks (~1 GB/s; a dataset of 1.3 M
        tokens takes milliseconds).
        """
        try:
            vocab = int(self.metadata["tokenizer"]["vocab_size"])
        except (KeyError, TypeError, ValueError):
            raise DatasetFormatError(f"{self.path_prefix}.json: no tokenizer.vocab_size; "
                                     f"{_FIX}") from None
        path = self.path_prefix + ".bin"
        dtype = np.dtype(self._token_dtype)
        if os.path.getsize(path) == 0:
            return
        tokens = np.memmap(path, dtype=dtype, mode="r")
        chunk = 1 << 24
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            low, high = int(part.min()), int(part.max())
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise DatasetFormatError(f"{path}: token id {bad} outside the dataset's "
                                         f"vocabulary [0, {vocab}) (corrupt or written by "
                                         f"another tokenizer); {_FIX}")

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def max_length(self) -> int:
        """Longest training length L in the dataset (0 when empty)."""
        return int(self.lengths.max()) if len(self.lengths) else 0

    @property
    def tokenizer_description(self) -> dict[str, Any]:
        """The tokenizer identity stored at preprocessing time."""
        return dict(self.metadata["tokenizer"])

    def _check_index(self, i: int) -> int:
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        return i % n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored sample: ``(tokens int64 [S], loss_mask float32 [S])``, S = L + 1."""
        i = self._check_index(int(i))
        tokens = torch.from_numpy(self._tokens[i].astype(np.int64))
        mask = torch.from_numpy(self._mask[i].astype(np.float32))
        return tokens, mask

    def get_example(self, i: int) -> SFTExample:
        """The causal-LM view of sample ``i``: input_ids, labels, loss_mask, each ``[L]``."""
        tokens, mask = self[i]
        return SFTExample(tokens[:-1], tokens[1:], mask[1:])

    def check_tokenizer(self, tokenizer: Optional[SFTTokenizer],
                        seq_length: Optional[int] = None) -> None:
        """Fails unless ``tokenizer`` (and ``seq_length``, if given) fit this dataset.

        Args:
            tokenizer: The tokenizer the training run built from its flags (None: skip).
            seq_length: The run's ``--seq-length``; every L must be <= it.

        Raises:
            DatasetFormatError: Different tokenizer identity or samples longer than
                ``seq_length``.
        """
        stored = self.metadata["tokenizer"]
        mine = stored if tokenizer is None else tokenizer.describe()
        diff = _tokenizer_diff(stored, mine)
        if diff:
            raise DatasetFormatError(
                f"{self.path_prefix}.json: dataset was tokenized with {stored} but the run uses "
                f"{mine} (differs in {', '.join(diff)}); pass the same --tokenizer-type/"
                "--tokenizer-model or re-run tools/preprocess_sft.py")
        if seq_length is not None and self.max_length > seq_length:
            raise DatasetFormatError(
                f"{self.path_prefix}: longest sample has {self.max_length} training positions "
                f"> --seq-length {seq_length}; raise --seq-length or re-run "
                "tools/preprocess_sft.py with --overlong truncate|drop")


def load_sft_dataset(data_path: str | Sequence[str], *, tokenizer: Optional[SFTTokenizer] = None,
                     seq_length: Optional[int] = None) -> SFTDataset:
    """Opens ``--data-path`` (one prefix) and checks it against the run's settings.

    Args:
        data_path: A prefix, or Megatron's ``--data-path`` list holding exactly one prefix
            (weighted blends are not supported for SFT).
        tokenizer: If given, must match the tokenizer stored with the dataset.
        seq_length: If given, every sample's L must be <= it.

    Raises:
        ValueError: ``data_path`` is empty or a blend.
        DatasetFormatError: See :class:`SFTDataset` and :meth:`SFTDataset.check_tokenizer`.
    """
    paths = [data_path] if isinstance(data_path, str) else list(data_path)
    if len(paths) != 1:
        raise ValueError(f"--data-path takes exactly one dataset prefix for SFT, got {paths}; "
                         "preprocess all data into one prefix")
    dataset = SFTDataset(paths[0], verify_tokens=True)
    if tokenizer is not None or seq_length is not None:
        dataset.check_tokenizer(tokenizer, seq_length)
    return dataset


class SampleSources(NamedTuple):
    """The run's data: the training source and the validation source (``None``: none).

    Attributes:
        train: What the training sampler draws from.
        valid: The validation set (maybe empty: ``--split`` with a zero validation part).
        valid_origin: Where ``valid`` comes from, for messages (``--split ...`` or
            ``--valid-data-path ...``; empty when there is no validation set).
    """

    train: Any
    valid: Optional[Any]
    valid_origin: str = ""
    valid_sets: tuple = ()  # ((name, source, origin), ...): one loss each (blends)


def build_sample_sources(cfg: Any) -> SampleSources:
    """``--mock-data`` or ``--data-path``, cut by ``--split``, plus ``--valid-data-path``.

    Without ``--split`` every sample of the data trains (no validation part) and the
    training source is the dataset itself; with it, the train and validation parts are
    Megatron's contiguous ranges (:func:`megatron.skrull.samples.split_ranges`; the test
    part is held out).  ``--valid-data-path`` replaces the validation part and must be
    tokenized like the training data.

    Args:
        cfg: The :class:`megatron.skrull.arguments.RunConfig`.

    Raises:
        ValueError, DatasetFormatError: Unusable data or flags (message names the fix).
    """
    from megatron.skrull import samples
    from megatron.skrull.tokenizer import build_tokenizer

    from megatron.skrull.blend import run_blends

    d = cfg.data
    tokenizer = None
    if not d.use_mock and (d.tokenizer_type or d.tokenizer_model):
        tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
    blend, valid_blend = (None, None) if d.use_mock else run_blends(d)
    if blend is not None and len(blend.prefixes) > 1:
        return _blended_sources(cfg, blend, valid_blend, tokenizer)
    if d.use_mock:
        lengths = None
        if d.use_varlen_dataset:  # Megatron-LM dev's MockVarlenDataset lengths
            from megatron.skrull import varlen_mock

            lengths = varlen_mock.sample_positions(
                varlen_mock.read_config(d.varlen_mock_config, cfg.seq_length),
                d.mock_num_samples, cfg.seq_length)
        base = samples.SyntheticSFTSource(d.mock_num_samples, cfg.seq_length,
                                          vocab_size=cfg.model.vocab_size or 64,
                                          seed=cfg.optim.seed, lengths=lengths)
    else:
        base = samples.DatasetSource(load_sft_dataset(blend.prefixes[0], tokenizer=tokenizer,
                                                      seq_length=cfg.seq_length))
    train, valid, origin = base, None, ""
    if d.split is not None:
        what = "--mock-data" if d.use_mock else f"--data-path {blend.prefixes[0]}"
        parts = [samples.SubsetSource(base, np.arange(lo, hi),
                                      f"{name} part [{lo}, {hi}) of the {len(base)} samples "
                                      f"of {what} (--split {d.split})")
                 for name, (lo, hi) in zip(samples.SPLIT_NAMES,
                                           samples.split_ranges(len(base),
                                                                samples.parse_split(d.split)))]
        train, valid, origin = parts[0], parts[1], parts[1].description
    if valid_blend is not None and len(valid_blend.prefixes) > 1:
        return SampleSources(train, None, "", _validation_sets(valid_blend, base, tokenizer,
                                                                cfg.seq_length))
    if valid_blend is not None:
        path = valid_blend.prefixes[0]
        valid = _validation_dataset(path, base, tokenizer, cfg.seq_length)
        origin = f"--valid-data-path {path}"
    return SampleSources(train, valid, origin)


def _blended_sources(cfg: Any, blend: Any, valid_blend: Any,
                     tokenizer: Optional[SFTTokenizer]) -> SampleSources:
    """A weighted blend (:mod:`megatron.skrull.blend`): ``--split`` cuts each dataset, the
    training parts are blended, each validation part is its own validation set."""
    from megatron.skrull import samples
    from megatron.skrull.blend import ConcatSource, dataset_names

    names = dataset_names(blend.prefixes)
    bases = [samples.DatasetSource(load_sft_dataset(p, tokenizer=tokenizer,
                                                    seq_length=cfg.seq_length))
             for p in blend.prefixes]
    for prefix, base in zip(blend.prefixes[1:], bases[1:]):
        diff = _tokenizer_diff(base.dataset.tokenizer_description,
                               bases[0].dataset.tokenizer_description)
        if diff:
            raise DatasetFormatError(f"{prefix} and {blend.prefixes[0]} were tokenized "
                                     f"differently (in {', '.join(diff)}); preprocess every "
                                     "dataset of a blend with the same tokenizer")
    trains, valid_sets = bases, []
    if cfg.data.split is not None:
        weights, trains = samples.parse_split(cfg.data.split), []
        for name, prefix, base in zip(names, blend.prefixes, bases):
            (lo, hi), (vlo, vhi), _ = samples.split_ranges(len(base), weights)
            trains.append(samples.SubsetSource(base, np.arange(lo, hi)))
            origin = (f"validation part [{vlo}, {vhi}) of the {len(base)} samples of {prefix} "
                      f"(--split {cfg.data.split})")
            valid_sets.append((name, samples.SubsetSource(base, np.arange(vlo, vhi), origin),
                               origin))
    for prefix, part in zip(blend.prefixes, trains):
        if len(part) == 0:
            raise ValueError(f"--data-path {prefix}: no training sample left (--split "
                             f"{cfg.data.split}); give it more samples or a larger train weight")
    train = ConcatSource(trains, names, blend.weights)
    if valid_blend is not None:
        valid_sets = _validation_sets(valid_blend, bases[0], tokenizer, cfg.seq_length)
    return SampleSources(train, None, "", tuple(valid_sets))


def _validation_sets(blend: Any, train: Any, tokenizer: Optional[SFTTokenizer],
                     seq_length: int) -> tuple:
    """``--valid-data-path P1 P2 ...``: one validation set (one loss) per prefix."""
    from megatron.skrull.blend import dataset_names

    if blend.weights is not None:
        raise ValueError("--valid-data-path: each validation dataset is evaluated on its own "
                         "(one loss per prefix, like Megatron's --multiple-validation-sets); "
                         "drop the weights")
    return tuple((name, _validation_dataset(p, train, tokenizer, seq_length),
                  f"--valid-data-path {p}")
                 for name, p in zip(dataset_names(blend.prefixes), blend.prefixes))


def make_sampler(source: Any, global_batch_size: int, seed: int):
    """The training sampler of ``source``: a blend's, else :class:`GlobalBatchSampler`."""
    from megatron.skrull.blend import BlendedBatchSampler, ConcatSource

    if isinstance(source, ConcatSource):
        return BlendedBatchSampler(source.sizes, source.weights, global_batch_size, seed,
                                   names=source.names)
    return GlobalBatchSampler(len(source), global_batch_size, seed)


def _validation_dataset(path: str, train: Any, tokenizer: Optional[SFTTokenizer],
                        seq_length: int):
    """``--valid-data-path``: opened, checked, tokenized like the training data."""
    from megatron.skrull.samples import DatasetSource

    if not any(os.path.exists(f) for f in dataset_paths(path).values()):
        raise DatasetFormatError(f"--valid-data-path {path}: no dataset at this prefix "
                                 f"({path}.bin/.idx/.json do not exist); give the "
                                 "--output-prefix written by tools/preprocess_sft.py")
    try:
        dataset = load_sft_dataset(path, tokenizer=tokenizer, seq_length=seq_length)
    except (DatasetFormatError, ValueError) as exc:
        raise DatasetFormatError(f"--valid-data-path: {exc}") from None
    stored = dataset.tokenizer_description
    mine = train.dataset.tokenizer_description
    diff = _tokenizer_diff(stored, mine)
    if diff:
        raise DatasetFormatError(
            f"--valid-data-path {path} was tokenized with {stored} but --data-path with {mine} "
            f"(differs in {', '.join(diff)}); preprocess both with the same tokenizer")
    return DatasetSource(dataset)


class GlobalBatchSampler:
    """Deterministic, epoch-aware global batches of sample indices.

    Iteration ``it`` belongs to epoch ``it // batches_per_epoch``; each epoch is a fresh
    permutation of ``range(num_samples)`` drawn from ``PCG64(SeedSequence([seed, epoch]))``
    (keying on the pair rather than ``seed + epoch`` keeps runs with neighbouring seeds from
    sharing epochs).  Each epoch is cut into ``num_samples // global_batch_size`` batches and
    its leftover (< one batch) is dropped, so every batch holds distinct samples and epochs
    stay aligned with iterations.  The batch of an iteration is a pure function of
    ``(num_samples, global_batch_size, seed, shuffle, iteration)``: every rank computes the
    same batches with no communication, and resuming at an iteration is exact.

    Args:
        num_samples: Dataset size (>= global_batch_size).
        global_batch_size: Samples per iteration (``--global-batch-size``).
        seed: Data-order seed (``--seed``).
        start_iteration: First iteration to yield (e.g. the checkpoint's iteration).
        shuffle: Permute each epoch; False keeps dataset order (useful for debugging).

    Iterating yields ``list[int]`` batches forever, advancing :attr:`iteration`; the training
    loop stops it at ``--train-iters``.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int,
                 start_iteration: int = 0, *, shuffle: bool = True) -> None:
        if global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {global_batch_size}")
        if num_samples < global_batch_size:
            raise ValueError(f"dataset has {num_samples} samples, fewer than "
                             f"--global-batch-size {global_batch_size}; use a larger dataset "
                             "or a smaller global batch")
        if start_iteration < 0:
            raise ValueError(f"start_iteration must be >= 0, got {start_iteration}")
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.iteration = int(start_iteration)
        self._cached_epoch: Optional[int] = None
        self._cached_perm: Optional[np.ndarray] = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self.iteration // self.batches_per_epoch

    @property
    def consumed_samples(self) -> int:
        """Samples handed out so far (Megatron's ``consumed_train_samples``)."""
        return self.iteration * self.global_batch_size

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch``: int64 ``[num_samples]``."""
        if self._cached_epoch != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
                    [self.seed, epoch])))
                perm = rng.permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples, dtype=np.int64)
            self._cached_epoch, self._cached_perm = epoch, perm
        return self._cached_perm

    def _start(self, iteration: int) -> tuple[int, int]:
        """``(epoch, offset in its permutation)`` of ``iteration``'s first sample."""
        epoch, pos = divmod(iteration, self.batches_per_epoch)
        return epoch, pos * self.global_batch_size

    def _size(self, iteration: int) -> int:
        return self.global_batch_size  # (a batch-size schedule varies it: batch_size_samplers)

    def batch(self, iteration: int) -> list[int]:
        """Sample indices of ``iteration`` (``global_batch_size`` distinct ints)."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        epoch, start = self._start(iteration)
        perm = self.epoch_permutation(epoch)
        return [int(i) for i in perm[start:start + self._size(iteration)]]

    def __iter__(self) -> "GlobalBatchSampler":
        return self

    def __next__(self) -> list[int]:
        out = self.batch(self.iteration)
        self.iteration += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Resume state: the next iteration plus the settings that define the order."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "num_samples": self.num_samples, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from :meth:`state_dict` output.

        Raises:
            ValueError: The state was saved with a different dataset size, global batch,
                seed or shuffle setting (the data order would silently change).
        """
        if "blend" in state:
            raise ValueError("the checkpoint's data position is of a weighted blend; resume "
                             "with the same --data-path weights and datasets")
        check_schedule(state, getattr(self, "schedule_spec", None))
        for key in ("num_samples", "global_batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this run has "
                                 f"{getattr(self, key)!r}; resume with the same --data-path, "
                                 "--split, --global-batch-size and --seed")
        if "iteration" in state:
            iteration = int(state["iteration"])
        else:
            consumed = int(state["consumed_samples"])
            if consumed % self.global_batch_size:
                raise ValueError(f"consumed_samples {consumed} is not a multiple of "
                                 f"--global-batch-size {self.global_batch_size}")
            iteration = consumed // self.global_batch_size
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        self.iteration = iteration
