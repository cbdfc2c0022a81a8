"""Global batches whose size follows a batch-size schedule (``megatron/skrull/batch_size.py``).

Iteration ``i`` draws ``sizes.size(i)`` samples, where the size is Megatron's function of the
samples consumed before ``i``.  Both samplers reduce to their constant-size base class when
the size never changes, batch for batch:

* :class:`ScheduledBatchSampler` (one dataset): each epoch is the base's permutation; a batch
  takes the next ``size`` samples of it, and a batch that would cross the epoch's end starts
  the next epoch instead (the leftover is dropped, as the base drops ``N mod G``), so every
  batch holds distinct samples;
* :class:`ScheduledBlendedBatchSampler` (a weighted blend): iteration ``i`` takes blend
  positions ``[consumed before i, consumed before i + size)``.

Resume state: the base's plus the schedule's flag, which a resume must repeat.
"""
from __future__ import annotations

from typing import Any, Optional

from megatron.skrull.batch_size import GlobalBatchSizes
from megatron.skrull.blend import BlendedBatchSampler, ConcatSource
from megatron.skrull.data import GlobalBatchSampler, make_sampler


class ScheduledBatchSampler(GlobalBatchSampler):
    """:class:`~megatron.skrull.data.GlobalBatchSampler` with scheduled batch sizes.

    Args:
        num_samples: Dataset size (>= the schedule's largest batch).
        sizes: The run's :class:`~megatron.skrull.batch_size.GlobalBatchSizes`.
        seed: Data-order seed (``--seed``).
        start_iteration: First iteration to yield.
        shuffle: Permute each epoch.
    """

    def __init__(self, num_samples: int, sizes: GlobalBatchSizes, seed: int,
                 start_iteration: int = 0, *, shuffle: bool = True) -> None:
        if num_samples < sizes.max_size:
            raise ValueError(f"dataset has {num_samples} samples, fewer than the largest "
                             f"global batch {sizes.max_size} of {sizes.args.spec}; use a "
                             "larger dataset or smaller batch sizes")
        super().__init__(num_samples, sizes.final, seed, start_iteration, shuffle=shuffle)
        self.batch_sizes, self.schedule_spec = sizes, sizes.args.spec
        self._starts = [(0, 0)]  # (epoch, offset) of iterations 0.. while the size changes

    def _size(self, iteration: int) -> int:
        return self.batch_sizes.size(iteration)

    def _next_start(self, iteration: int) -> tuple[int, int]:
        """Where iteration ``iteration + 1`` starts, from where ``iteration`` does."""
        epoch, offset = self._starts[iteration]
        offset += self._size(iteration)
        if offset + self._size(iteration + 1) > self.num_samples:
            return epoch + 1, 0
        return epoch, offset

    def _start(self, iteration: int) -> tuple[int, int]:
        settled = self.batch_sizes.settled_iteration(iteration)
        last = iteration if settled is None else settled
        while len(self._starts) <= last:
            self._starts.append(self._next_start(len(self._starts) - 1))
        if settled is None:
            return self._starts[iteration]
        # From the settled iteration on, whole batches of the final size, as the base cuts.
        epoch, offset = self._starts[settled]
        size, k = self.batch_sizes.final, iteration - settled
        left = (self.num_samples - offset) // size  # batches left in that epoch (>= 1)
        if k < left:
            return epoch, offset + k * size
        full, rest = divmod(k - left, self.batches_per_epoch)
        return epoch + 1 + full, rest * size

    @property
    def epoch(self) -> int:
        return self._start(self.iteration)[0]

    @property
    def consumed_samples(self) -> int:
        return self.batch_sizes.consumed_before(self.iteration)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "batch_size_schedule": self.schedule_spec}


class ScheduledBlendedBatchSampler(BlendedBatchSampler):
    """:class:`~megatron.skrull.blend.BlendedBatchSampler` with scheduled batch sizes
    (arguments as the base's, ``sizes`` for ``global_batch_size``)."""

    def __init__(self, sizes_of_datasets, weights, sizes: GlobalBatchSizes, seed: int,
                 start_iteration: int = 0, *, names=()) -> None:
        super().__init__(sizes_of_datasets, weights, sizes.final, seed, start_iteration,
                         names=names)
        self.batch_sizes, self.schedule_spec = sizes, sizes.args.spec

    def _consumed(self, iteration: int) -> int:
        return self.batch_sizes.consumed_before(iteration)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "batch_size_schedule": self.schedule_spec}


def scheduled_sampler(source: Any, global_batch_size: int, seed: int,
                      sizes: Optional[GlobalBatchSizes] = None):
    """The training sampler: :func:`megatron.skrull.data.make_sampler`'s, or with ``sizes``
    the scheduled one of the same kind."""
    if sizes is None:
        return make_sampler(source, global_batch_size, seed)
    if isinstance(source, ConcatSource):
        return ScheduledBlendedBatchSampler(source.sizes, source.weights, sizes, seed,
                                            names=source.names)
    return ScheduledBatchSampler(len(source), sizes, seed)
