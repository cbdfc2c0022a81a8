"""What the training loop needs from data: a sample source and a global-batch sampler.

The loop only touches data through :class:`SampleSource`: per-sample ``lengths`` (known up
front, so every rank plans the whole global batch), ``num_loss_tokens(ids)`` (the global loss
normaliser, computed by every rank without communication) and ``sample(i)`` (read only for
the samples this rank holds).  :class:`SyntheticSFTSource` is the built-in learnable task
behind ``--mock-data``; :class:`DatasetSource` adapts a preprocessed dataset
(``megatron.skrull.data.SFTDataset``: ``lengths`` and ``get_example(i)``).

Samplers follow ``megatron.skrull.data.GlobalBatchSampler``'s interface: ``next(sampler)``
gives the next global batch (a list of sample indices), ``state_dict``/``load_state_dict``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

__all__ = ["TokenSample", "SampleSource", "SyntheticSFTSource", "DatasetSource",
           "ConcatSource", "GlobalBatchSampler"]


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
    clipped to ``[min_length, max_length]``; every sample is a pure function of ``seed``.
    """

    BOS = 1
    NUM_KEYS = 8

    def __init__(self, num_samples: int, max_length: int, *, vocab_size: int = 64,
                 seed: int = 1234, min_length: int = 8):
        if max_length < min_length or min_length < 4:
            raise ValueError(f"need 4 <= min_length ({min_length}) <= max_length ({max_length})")
        if vocab_size < 2 + self.NUM_KEYS + 8:
            raise ValueError(f"vocab_size must be >= {2 + self.NUM_KEYS + 8}")
        self._vocab = vocab_size
        self._seed = seed
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
    """Adapts a preprocessed dataset (``lengths`` + ``get_example(i)``) to :class:`SampleSource`.

    ``get_example(i)`` must return ``(input_ids, labels, loss_mask)``, each ``[lengths[i]]``
    (``megatron.skrull.data.SFTDataset``'s causal-LM view).  Loss-token counts are read from
    the masks on first use and cached, so the normaliser costs one mask read per sample.
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.lengths = np.asarray(dataset.lengths, dtype=np.int64)
        self._loss_tokens = np.full(len(self.lengths), -1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

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


class ConcatSource:
    """Several sources seen as one (several ``--data-path`` prefixes)."""

    def __init__(self, sources: Sequence[Any]):
        if not sources:
            raise ValueError("ConcatSource needs at least one source")
        self.sources = list(sources)
        self.lengths = np.concatenate([s.lengths for s in self.sources]).astype(np.int64)
        self._starts = np.cumsum([0] + [len(s) for s in self.sources])

    def __len__(self) -> int:
        return len(self.lengths)

    def _locate(self, index: int) -> tuple[Any, int]:
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.sources[k], int(index - self._starts[k])

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        total = 0
        for i in np.asarray(indices, dtype=np.int64):
            src, j = self._locate(int(i))
            total += src.num_loss_tokens(np.asarray([j]))
        return total

    def sample(self, index: int) -> TokenSample:
        src, j = self._locate(int(index))
        return src.sample(j)


class GlobalBatchSampler:
    """Deterministic stream of global batches over a dataset, reshuffled every epoch.

    Global batch ``b`` is positions ``[b G, (b+1) G)`` of the endless stream
    ``perm(epoch 0) ++ perm(epoch 1) ++ ...`` (``perm`` seeded by ``(seed, epoch)``), so the
    state is one integer and a resumed run sees exactly the batches of the uninterrupted one.
    Same interface as ``megatron.skrull.data.GlobalBatchSampler`` (which drops each epoch's
    leftover instead and needs at least one global batch of samples).
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if num_samples < 1 or global_batch_size < 1:
            raise ValueError("GlobalBatchSampler needs num_samples >= 1 and global_batch_size >= 1")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.iteration = 0
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            self._cache = {epoch: np.random.default_rng((self.seed, epoch)).permutation(
                self.num_samples)}
        return self._cache[epoch]

    def __iter__(self) -> "GlobalBatchSampler":
        return self

    def __next__(self) -> list[int]:
        """Dataset indices of the next global batch (``global_batch_size`` ints)."""
        pos = self.iteration * self.global_batch_size + np.arange(self.global_batch_size)
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for epoch in np.unique(pos // self.num_samples):
            sel = pos // self.num_samples == epoch
            out[sel] = self._perm(int(epoch))[pos[sel] % self.num_samples]
        self.iteration += 1
        return [int(i) for i in out]

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "global_batch_size", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint sampler has {key}={state[key]} but this run has "
                                 f"{getattr(self, key)}; resume with the same data and "
                                 f"--global-batch-size/--seed")
        self.iteration = int(state["iteration"])
