"""WLB-LLM's packing with outlier delay as a baseline (Wang et al., OSDI'25, arXiv 2503.17924).

WLB-LLM balances the micro-batches of a pipeline: documents of variable length are packed
into a fixed number of micro-batches of at most ``L_max`` tokens so that their *workload*
(attention, quadratic in a document's length, plus linear terms, profiled) is even, and
every document is sharded over the CP ranks on its own ("per-document sharding": each rank
holds ``2`` of its ``2 N`` chunks, so each rank does ``1/N`` of every document's attention).
Documents so long that no packing balances them (*outliers*) are delayed: they wait in a
queue until enough of them have gathered to give one to every micro-batch of an iteration.
No code was released; this is our reading of the paper's text (section 4):

* :func:`wlb_pack` (the ``wlb-llm`` policy): each DP rank takes its contiguous slice of the
  global batch (as a data loader feeds a DP replica) and packs it into the fewest
  micro-batches its tokens need (``L_max``: our bucket on every CP rank, zigzag padding
  included), documents in descending workload (the cost model's per-sample seconds, i.e.
  ``c_linear`` x linear + ``c_attention`` x attention FLOPs, WLB's profiled form; ties by
  index), each into the micro-batch with the least workload that has room; a document
  that fits none opens a new micro-batch (WLB would delay it).  All samples distributed.
* :class:`OutlierDelay` (stateful, across iterations): a per-batch scheduler must place
  every sample it is given, so the delay is a filter on the stream of global batches,
  applied before scheduling.  Outliers (longer than a threshold) enter the queue of the
  highest threshold they exceed; a queue releases all it holds into the current batch as
  soon as it holds ``release`` documents (the number of micro-batches of an iteration);
  :meth:`OutlierDelay.flush` empties them at the end.  Every document is still trained
  exactly once; iteration sizes vary.  Benchmarks compare it over a window of batches.

Differences from the paper: WLB's ``L_max`` is a token count per micro-batch, ours a
per-CP-rank bucket (the same for all-CP micro-batches, padding aside); WLB fixes the
micro-batch count from the training configuration, we take the fewest the tokens need;
WLB's adaptive choice between per-sequence and per-document sharding (by kernel
efficiency) is not modelled: every document is sharded per document (our zigzag
``distributed`` placement).
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import numpy as np

from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.sharding import shard_tokens


def wlb_groups(lengths, costs, dp_size: int, cp_size: int, bucket_size: int
               ) -> list[list[list[int]]]:
    """:func:`wlb_pack`'s samples per DP rank and micro-batch, ``[D][M_d]`` lists."""
    out = []
    for part in np.array_split(np.arange(len(lengths)), dp_size):
        ids = part.tolist()
        if not ids:
            out.append([])
            continue
        shard = {i: shard_tokens(int(lengths[i]), cp_size) for i in ids}
        m = max(1, -(-sum(shard.values()) // bucket_size))
        bins = [[] for _ in range(m)]
        room = [bucket_size] * m
        heap = [(0.0, b) for b in range(m)]  # (workload, bin): least workload first
        for i in sorted(ids, key=lambda i: (-float(costs[i]), i)):
            skipped, placed = [], None
            while heap:
                work, b = heapq.heappop(heap)
                if room[b] >= shard[i]:
                    placed = (work, b)
                    break
                skipped.append((work, b))
            if placed is None:  # fits no micro-batch: a new one
                bins.append([])
                room.append(bucket_size)
                placed = (0.0, len(bins) - 1)
            work, b = placed
            bins[b].append(i)
            room[b] -= shard[i]
            for item in skipped:
                heapq.heappush(heap, item)
            heapq.heappush(heap, (work + float(costs[i]), b))
        out.append([sorted(g) for g in bins if g])
    return out


def wlb_pack(lengths, costs, dp_size, cp_size, bucket_size):
    """WLB-LLM: workload-balanced variable-length packing, per-document sharding (all-CP)."""
    return [[MicroBatch(distributed=tuple(g), local=((),) * cp_size) for g in rank]
            for rank in wlb_groups(lengths, costs, dp_size, cp_size, bucket_size)]


class OutlierDelay:
    """WLB-LLM's outlier delay over a stream of global batches (see the module doc).

    Args:
        thresholds: Lengths above which a document is an outlier, one queue per threshold.
        release: Documents a queue gathers before releasing them all into a batch.
    """

    def __init__(self, thresholds: Sequence[int], release: int):
        if not thresholds or release < 1:
            raise ValueError("OutlierDelay needs at least one threshold and release >= 1")
        self.thresholds = sorted(int(t) for t in thresholds)
        self.release = int(release)
        self.queues: list[list[tuple[int, int]]] = [[] for _ in self.thresholds]

    def _level(self, length: int) -> int:
        level = -1
        for j, t in enumerate(self.thresholds):
            if length > t:
                level = j
        return level

    def step(self, batch: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ``(sample id, length)`` pairs to train now: ``batch``'s non-outliers plus
        every queue that reached ``release`` (its documents oldest first)."""
        now = []
        for sid, length in batch:
            level = self._level(int(length))
            if level < 0:
                now.append((sid, int(length)))
            else:
                self.queues[level].append((sid, int(length)))
        for j, queue in enumerate(self.queues):
            if len(queue) >= self.release:
                now.extend(queue)
                self.queues[j] = []
        return now

    def flush(self) -> list[tuple[int, int]]:
        """Everything still waiting (the end of the data)."""
        out = [x for q in self.queues for x in q]
        self.queues = [[] for _ in self.thresholds]
        return out

    def pending(self) -> int:
        return sum(len(q) for q in self.queues)


__all__ = ["OutlierDelay", "wlb_groups", "wlb_pack"]
