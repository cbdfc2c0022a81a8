"""What the training loop needs from data: a sample source and a global-batch sampler.

The loop only touches data through :class:`SampleSource`: per-sample ``lengths`` (known up
front, so every rank plans the whole global batch), ``num_loss_tokens(ids)`` (the global loss
normaliser, computed by every rank without communication) and ``sample(i)`` (read only for
the samples this rank holds).  :class:`SyntheticSFTSource` is the built-in learnable task
behind ``--mock-data``; :class:`DatasetSource` adapts a preprocessed ``--data-path``
dataset (:class:`megatron.skrull.data.SFTDataset`).  Global batches come from
:class:`megatron.skrull.data.GlobalBatchSampler`.

``--split 969,30,1`` cuts one source into train / validation / test parts the way Megatron's
``BlendedMegatronDatasetBuilder`` does: the weights are normalised to sum 1 and part ``k``
is the contiguous range ``[round(c_k * N), round(c_{k+1} * N))`` of samples in dataset
order, ``c`` the cumulative weights (:func:`parse_split`, :func:`split_ranges`); each part
is a :class:`SubsetSource` view.  The split is a pure function of the weights and ``N``, so
every rank, and a resumed run, sees the same parts.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Protocol

import numpy as np

__all__ = ["TokenSample", "SampleSource", "SyntheticSFTSource", "DatasetSource",
           "SubsetSource", "parse_split", "split_ranges"]

SPLIT_NAMES = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class TokenSample:
    """One training sample, already aligned for next-token prediction.

    Attributes:
        tokens: ``[S]`` int64 input ids.
        labels: ``[S]`` int64 target of each position (the next token of the same sample).
        loss_mask: ``[S]`` float32, 1 where the position's label is trained on.
    """

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray


class SampleSource(Protocol):
    """Random-access samples whose lengths are known up front."""

    lengths: np.ndarray  # [N] int64 training positions of every sample

    def __len__(self) -> int: ...

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        """Positions with ``loss_mask == 1`` summed over ``indices``."""

    def sample(self, index: int) -> TokenSample: ...


class SyntheticSFTSource:
    """Learnable synthetic SFT task with long-tailed lengths (``--mock-data``).

    Sample ``i``: ``[BOS, key, x_0, x_1, ...]`` where ``x_{j+1} = (x_j + step(key)) mod
    span + first`` -- the model must look back to the key of *its own* sample to predict,
    so the loss only falls when attention respects document boundaries.  The prompt
    (``BOS, key, x_0``) carries no loss.  Lengths are log-normal (median ``max_length / 8``)
    clipped to ``[min_length, max_length]``, or ``lengths`` where given (Megatron's varlen
    mock, :mod:`megatron.skrull.varlen_mock`); every sample is a pure function of ``seed``.
    """

    BOS = 1
    NUM_KEYS = 8

    def __init__(self, num_samples: int, max_length: int, *, vocab_size: int = 64,
                 seed: int = 1234, min_length: int = 8, lengths: Optional[np.ndarray] = None):
        if max_length < min_length or min_length < 4:
            raise ValueError(f"need 4 <= min_length ({min_length}) <= max_length ({max_length})")
        if vocab_size < 2 + self.NUM_KEYS + 8:
            raise ValueError(f"vocab_size must be >= {2 + self.NUM_KEYS + 8}")
        self._vocab = vocab_size
        self._seed = seed
        if lengths is not None:  # given (megatron.skrull.varlen_mock): [num_samples], in [4, max]
            self.lengths = np.asarray(lengths, dtype=np.int64).copy()
            if len(self.lengths) != num_samples or self.lengths.min() < 4 or \
                    self.lengths.max() > max_length:
                raise ValueError(f"lengths: need {num_samples} values in [4, {max_length}]")
        else:
            rng = np.random.default_rng(seed)
            median = max(min_length, max_length / 8)
            raw = np.exp(rng.normal(np.log(median), 0.9, size=num_samples))
            self.lengths = np.clip(raw, min_length, max_length).astype(np.int64)
            self.lengths[int(rng.integers(num_samples))] = max_length  # always span the range
        # Positions 2.. predict x_1..: labels of positions 0..S-2 exist, prompt ends at x_0.
        self._loss_tokens = self.lengths - 3

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        return int(self._loss_tokens[np.asarray(indices)].sum())

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, index: int) -> TokenSample:
        length = int(self.lengths[index])
        rng = np.random.default_rng((self._seed, int(index)))
        key = int(rng.integers(self.NUM_KEYS))
        first = 2 + self.NUM_KEYS
        span = self._vocab - first
        steps = 1 + key % max(1, span - 1)
        body = (int(rng.integers(span)) + steps * np.arange(length - 2)) % span + first
        tokens = np.concatenate([[self.BOS, 2 + key], body]).astype(np.int64)
        labels = np.concatenate([tokens[1:], [0]]).astype(np.int64)
        mask = np.zeros(length, dtype=np.float32)
        mask[2:length - 1] = 1.0  # predict x_1 .. x_last; the last position has no label
        return TokenSample(tokens=tokens, labels=labels, loss_mask=mask)


class DatasetSource:
    """Adapts :class:`megatron.skrull.data.SFTDataset` to :class:`SampleSource`.

    Uses the dataset's ``lengths`` (L, training positions) and ``get_example(i)`` ->
    ``(input_ids, labels, loss_mask)``, each ``[L]``.  Loss-token counts are read from the
    masks on first use and cached, so the normaliser costs one mask read per sample.
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.lengths = np.asarray(dataset.lengths, dtype=np.int64)
        self._loss_tokens = np.full(len(self.lengths), -1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def vocab_size(self) -> int:
        """Vocabulary the dataset was tokenized with (its stored tokenizer description)."""
        return int(self.dataset.tokenizer_description["vocab_size"])

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        indices = np.asarray(indices, dtype=np.int64)
        for i in indices[self._loss_tokens[indices] < 0]:
            self._loss_tokens[i] = int(np.count_nonzero(
                np.asarray(self.dataset.get_example(int(i))[2])))
        return int(self._loss_tokens[indices].sum())

    def sample(self, index: int) -> TokenSample:
        ids, labels, mask = self.dataset.get_example(int(index))
        return TokenSample(tokens=np.asarray(ids, dtype=np.int64),
                           labels=np.asarray(labels, dtype=np.int64),
                           loss_mask=np.asarray(mask, dtype=np.float32))


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split``: up to three train/validation/test weights, normalised.

    Weights are separated by ``,`` (or ``/``, Megatron's older form); missing trailing
    weights are 0 (``"98,2"`` is ``98,2,0``), e.g. ``"969,30,1"`` -> ``(0.969, 0.03, 0.001)``.

    Raises:
        ValueError: Not 1-3 non-negative numbers, or all zero; the message names the fix.
    """
    fix = (f"--split {split!r}: give up to three comma-separated non-negative weights for "
           "train,validation,test with a positive sum, e.g. --split 969,30,1")
    # Megatron-LM's example scripts pass "--split '99,1,0'" inside an unquoted variable, so
    # bash hands over the quotes too; Megatron's own parsing ignores them, and so do we.
    parts = [p.strip() for p in re.split(r"[,/]", split.strip().strip("'\""))]
    if not 1 <= len(parts) <= len(SPLIT_NAMES):
        raise ValueError(fix)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(fix) from None
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(fix)
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def split_ranges(num_samples: int, weights: tuple[float, ...]) -> list[tuple[int, int]]:
    """``[(begin, end)]`` sample ranges of the parts, as Megatron's dataset builder cuts them.

    Args:
        num_samples: Samples in the source (N).
        weights: Normalised weights (:func:`parse_split`).

    Returns:
        One half-open range per weight, contiguous, covering ``[0, N)`` in order.
    """
    bounds = [0.0]
    for w in weights:  # cumulative in the same order of float additions as Megatron
        bounds.append(bounds[-1] + w)
    return [(int(round(lo * float(num_samples))), int(round(hi * float(num_samples))))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


class SubsetSource:
    """A view of ``base`` holding the samples ``indices`` (a split part).

    Args:
        base: Any :class:`SampleSource`.
        indices: ``[n]`` int64 sample ids of ``base``; view sample ``i`` is ``base``'s
            ``indices[i]``.
        description: What the part is, for log lines and error messages.
    """

    def __init__(self, base: Any, indices: np.ndarray, description: str = ""):
        self.base, self.description = base, description
        self.indices = np.asarray(indices, dtype=np.int64)
        self.lengths = np.asarray(base.lengths, dtype=np.int64)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def vocab_size(self) -> int:
        return int(self.base.vocab_size)

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        return self.base.num_loss_tokens(self.indices[np.asarray(indices, dtype=np.int64)])

    def sample(self, index: int) -> TokenSample:
        return self.base.sample(int(self.indices[int(index)]))
