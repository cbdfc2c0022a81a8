"""Weighted dataset mixtures as Megatron writes them: ``--data-path W1 P1 W2 P2 ...``.

Flags (Megatron-LM's ``arguments.py`` names and rules, :func:`parse_blend`):

* ``--data-path``: one prefix, ``W1 P1 W2 P2 ...`` or ``P1 P2 ...`` (weights then follow
  the datasets' sizes); ``--split`` cuts *each* dataset into train / validation / test.
* ``--data-args-path FILE``: the same list read from a file (whitespace-separated).
* ``--train-data-path`` / ``--valid-data-path``: separate blends per split;
  ``--per-split-data-args-path FILE.json``: ``{"train": ..., "valid": ..., "test": ...}``.

Training draws from :class:`ConcatSource` (the datasets' samples one after the other, so the
scheduler still sees one global batch of lengths) in the order of
:class:`BlendedBatchSampler`: position ``p`` of the blend goes to the dataset that Megatron's
``helpers.build_blending_indices`` (the C++ helper behind ``BlendedDataset``) picks -- the
one furthest behind its weight -- so every prefix of the blend, and so every global batch,
holds each dataset in proportion to its weight up to one sample.  The ``c``-th sample drawn
from dataset ``d`` is ``permutation(seed, d, epoch)[c mod n_d]`` with ``epoch = c // n_d``:
each dataset is reshuffled every time it is exhausted, independently of the others.
Everything is a pure function of ``(weights, sizes, seed, global batch, iteration)``, so
every rank draws the same batches and a resume is exact.

Differences from Megatron's ``BlendedDataset`` (megatron-core 0.16): the blend is extended
on demand instead of being sized to ``--train-iters`` up front (the same indices: the
helper's output does not depend on the size beyond each position), and a dataset's epochs
are permutations of its samples (Megatron's ``GPTDataset`` shuffles documents it packs into
fixed-length samples; SFT samples are never packed across documents).
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from megatron.skrull.batch_size import check_schedule


@dataclasses.dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their normalised weights (``None``: by dataset size)."""

    prefixes: tuple[str, ...]
    weights: Optional[tuple[float, ...]] = None


def parse_blend(items: Sequence[str], flag: str = "--data-path") -> Blend:
    """Megatron's blend list: ``[P]``, ``[W1, P1, W2, P2, ...]`` or ``[P1, P2, ...]``.

    Raises:
        ValueError: Empty, a weight that is not a positive number, or weights on only some
            datasets; the message names the fix.
    """
    items = [str(i).strip() for i in items]
    fix = (f"{flag}: give one prefix, weight-prefix pairs (e.g. {flag} 0.3 data/chat 0.7 "
           "data/code) or prefixes only")
    if not items:
        raise ValueError(f"{fix}; got nothing")
    numbers = [_number(i) for i in items[0::2]]
    if len(items) % 2 or all(n is None for n in numbers):
        if any(_number(i) is not None for i in items) and len(items) > 1:
            raise ValueError(f"{fix}; got {' '.join(items)}")
        return Blend(tuple(items))
    if any(n is None for n in numbers) or any(_number(p) is not None for p in items[1::2]):
        raise ValueError(f"{fix}; got {' '.join(items)}")
    if any(not np.isfinite(n) or n <= 0 for n in numbers):
        raise ValueError(f"{flag}: every weight must be a positive number; got "
                         f"{' '.join(items[0::2])}")
    total = float(sum(numbers))
    return Blend(tuple(items[1::2]), tuple(n / total for n in numbers))


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def read_data_args(path: str, flag: str) -> Any:
    """The contents of ``--data-args-path`` (a whitespace-separated list) or
    ``--per-split-data-args-path`` (JSON with ``train``/``valid``/``test`` keys)."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} does not exist")
    with open(path) as fh:
        text = fh.read()
    if flag == "--data-args-path":
        return text.split()
    try:
        per_split = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {path}: not JSON ({exc.msg})") from None
    if not isinstance(per_split, dict) or "train" not in per_split:
        raise ValueError(f'{flag} {path}: expected {{"train": ..., "valid": ..., "test": ...}}')
    return {k: (v.split() if isinstance(v, str) else list(v or ()))
            for k, v in per_split.items() if k in ("train", "valid", "test")}


def run_blends(d: Any) -> tuple[Optional[Blend], Optional[Blend]]:
    """The training and validation blends of a ``DataArgs`` (``None``: not given)."""
    if d.per_split_data_args_path:
        flag = "--per-split-data-args-path"
        split = read_data_args(d.per_split_data_args_path, flag)
        valid = split.get("valid")
        return (parse_blend(split["train"], flag + " train"),
                parse_blend(valid, flag + " valid") if valid else None)
    if d.data_args_path:
        train = parse_blend(read_data_args(d.data_args_path, "--data-args-path"),
                            "--data-args-path")
    elif d.train_data_path or d.data_path:
        flag = "--train-data-path" if d.train_data_path else "--data-path"
        train = parse_blend(d.train_data_path or d.data_path, flag)
    else:
        train = None
    valid = parse_blend(d.valid_data_path, "--valid-data-path") if d.valid_data_path else None
    return train, valid


def dataset_names(prefixes: Sequence[str]) -> list[str]:
    """Short, distinct names of datasets for log lines (base names, else indices)."""
    names = [os.path.basename(p.rstrip("/")) or p for p in prefixes]
    return names if len(set(names)) == len(names) else [f"{i}:{n}" for i, n in enumerate(names)]


class ConcatSource:
    """Several sample sources as one: id ``offsets[d] + i`` is sample ``i`` of source ``d``.

    Args:
        sources: :class:`~megatron.skrull.samples.SampleSource` per dataset.
        names: One name per dataset (log lines).
        weights: The blend's weights (``None``: proportional to the sources' sizes, as
            Megatron blends prefixes given without weights).
    """

    def __init__(self, sources: Sequence[Any], names: Sequence[str],
                 weights: Optional[Sequence[float]] = None) -> None:
        self.sources, self.names = list(sources), list(names)
        sizes = np.asarray([len(s) for s in self.sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lengths = np.concatenate([np.asarray(s.lengths, dtype=np.int64)
                                       for s in self.sources])
        total = max(1, int(sizes.sum()))
        self.weights = (list(weights) if weights is not None
                        else [float(n) / total for n in sizes])

    @property
    def sizes(self) -> list[int]:
        return [int(n) for n in np.diff(self.offsets)]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def vocab_size(self) -> int:
        return max(int(s.vocab_size) for s in self.sources)

    def locate(self, index: int) -> tuple[int, int]:
        """``(dataset, index in it)`` of concatenated id ``index``."""
        d = int(np.searchsorted(self.offsets, int(index), side="right")) - 1
        return d, int(index) - int(self.offsets[d])

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        return sum(self.sources[d].num_loss_tokens(indices[which == d] - self.offsets[d])
                   for d in np.unique(which))

    def sample(self, index: int):
        d, i = self.locate(index)
        return self.sources[d].sample(i)


def _blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():  # megatron.core warns about missing TE/Apex at import
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights,
                                   len(weights), size, False)
    return dataset_index, dataset_sample_index


class BlendedBatchSampler:
    """Global batches of a weighted blend over a :class:`ConcatSource` (module docstring).

    Args:
        sizes: Samples per dataset (``ConcatSource.sizes``).
        weights: Normalised weights, one per dataset.
        global_batch_size: Samples per iteration.
        seed: Data-order seed (``--seed``).
        start_iteration: First iteration to yield.
        names: Dataset names (log lines; not part of the resume check).
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int,
                 seed: int, start_iteration: int = 0, *, names: Sequence[str] = ()) -> None:
        if global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {global_batch_size}")
        if len(sizes) != len(weights) or not 1 <= len(sizes) < 32767 or min(sizes) < 1:
            raise ValueError(f"a blend needs 1 to 32766 non-empty datasets, got sizes {sizes}")
        self.sizes = [int(n) for n in sizes]
        self.weights = [float(w) for w in weights]
        self.global_batch_size, self.seed = int(global_batch_size), int(seed)
        self.iteration = int(start_iteration)
        self.names = list(names) or [str(i) for i in range(len(sizes))]
        self._offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._index = np.zeros(0, dtype=np.int16)
        self._sample_index = np.zeros(0, dtype=np.int64)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _extend(self, size: int) -> None:
        if size > len(self._index):  # prefix-stable: recomputing longer keeps the start
            size = max(size, 2 * len(self._index), 4096)
            self._index, self._sample_index = _blending_indices(
                np.asarray(self.weights, dtype=np.float64), size)

    def _permutation(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sizes):
                self._perms.clear()
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
                [self.seed, d + 1, epoch])))
            self._perms[key] = rng.permutation(self.sizes[d])
        return self._perms[key]

    def _consumed(self, iteration: int) -> int:
        """Blend positions drawn by iterations before ``iteration``."""
        return iteration * self.global_batch_size  # (batch_size_samplers: a schedule's)

    def batch(self, iteration: int) -> list[int]:
        """Concatenated sample ids of ``iteration`` (``global_batch_size`` ints)."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        lo, hi = self._consumed(iteration), self._consumed(iteration + 1)
        self._extend(hi)
        out = []
        for d, c in zip(self._index[lo:hi].tolist(), self._sample_index[lo:hi].tolist()):
            epoch, pos = divmod(c, self.sizes[d])
            out.append(int(self._offsets[d] + self._permutation(d, epoch)[pos]))
        return out

    def __iter__(self) -> "BlendedBatchSampler":
        return self

    def __next__(self) -> list[int]:
        out = self.batch(self.iteration)
        self.iteration += 1
        return out

    @property
    def consumed_samples(self) -> int:
        return self._consumed(self.iteration)

    def consumed_per_dataset(self, iteration: Optional[int] = None) -> list[tuple[str, int]]:
        """``(name, samples drawn)`` per dataset after ``iteration`` iterations."""
        end = self._consumed(self.iteration if iteration is None else int(iteration))
        self._extend(end)
        counts = np.bincount(self._index[:end], minlength=len(self.sizes))
        return list(zip(self.names, (int(c) for c in counts)))

    def state_dict(self) -> dict[str, Any]:
        """Resume state: the next iteration and what defines the order."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "blend": {"sizes": list(self.sizes), "weights": list(self.weights)},
                "num_samples": int(sum(self.sizes)),
                "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from :meth:`state_dict` output.

        Raises:
            ValueError: Saved without this blend, or with other datasets, weights, global
                batch or seed (the data order would silently change).
        """
        fix = ("resume with the same --data-path (weights and datasets), --split, "
               "--global-batch-size and --seed")
        blend = state.get("blend")
        check_schedule(state, getattr(self, "schedule_spec", None))
        if blend is None:
            raise ValueError(f"the checkpoint's data position was saved without a blend; {fix}")
        mine = self.state_dict()
        for key, saved, now in (("dataset sizes", blend["sizes"], self.sizes),
                                ("weights", blend["weights"], self.weights),
                                ("global batch", state["global_batch_size"],
                                 self.global_batch_size), ("seed", state["seed"], self.seed)):
            if list(np.atleast_1d(saved)) != list(np.atleast_1d(now)):
                raise ValueError(f"the checkpoint's blend has {key} {saved} but this run has "
                                 f"{now}; {fix}")
        self.iteration = int(state.get("iteration", mine["iteration"]))


def describe_blend(source: ConcatSource) -> str:
    """Rank 0's start-up line about the training blend."""
    parts = ", ".join(f"{name} {w:.3f} ({n} samples)"
                      for name, w, n in zip(source.names, source.weights, source.sizes))
    return f" skrull: training blend of {len(source.sources)} datasets (weight, size): {parts}"
