"""Baseline policies (docs/design.md section 7) on the same placement type as Skrull.

Every function returns ``dp_size`` lists of :class:`~skrull_ext.scheduler.plan.MicroBatch` (not yet
padded to equal counts; :func:`skrull_ext.scheduler.schedule` pads).  They share the cost
arrays of the Skrull scheduler, so predictions compare like with like.
"""
from __future__ import annotations

import heapq

import numpy as np

from skrull_ext import _backend
from skrull_ext.scheduler.flexsp import flexsp as _flexsp
from skrull_ext.scheduler.megatron_packing import dp_balanced, dynamic_cp
from skrull_ext.scheduler.wlb import wlb_pack
from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.sharding import shard_tokens, shard_tokens_array
from skrull_ext.scheduler.reference import lpt_partition


def _all_cp(idx, cp_size: int) -> MicroBatch:
    return MicroBatch(distributed=tuple(int(i) for i in idx),
                      local=tuple(() for _ in range(cp_size)))


def _next_fit(lengths, order, cp_size: int, bucket_size: int) -> list[list[int]]:
    """Packs ``order`` into consecutive groups whose per-rank shard tokens fit the bucket."""
    groups: list[list[int]] = []
    used = bucket_size + 1
    for i in order:
        sh = shard_tokens(int(lengths[i]), cp_size)
        if used + sh > bucket_size:
            groups.append([])
            used = 0
        groups[-1].append(int(i))
        used += sh
    return groups


def per_seq_cp_groups(lengths, costs, dp_size, cp_size, bucket_size):
    """The paper's DeepSpeed baseline's samples: one per micro-batch, DP round-robin."""
    return [[[i] for i in range(d, len(lengths), dp_size)] for d in range(dp_size)]


def all_cp_groups(lengths, costs, dp_size, cp_size, bucket_size):
    """Megatron static CP with packing: contiguous DP slices, next-fit in dataset order."""
    return [_next_fit(lengths, s, cp_size, bucket_size)
            for s in np.array_split(np.arange(len(lengths)), dp_size)]


def sorted_groups(lengths, costs, dp_size, cp_size, bucket_size):
    """LongAlign sorted batching: sorted lengths dealt round-robin, consecutive packs.

    Dealing the sorted batch one sequence at a time gives every DP rank the same length
    spectrum (so no rank gets all the long ones, and none sits idle when the whole batch
    would fit one pack); each rank then packs its sorted run next-fit into micro-batches
    of similar lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    return [_next_fit(lengths, order[d::dp_size], cp_size, bucket_size) for d in range(dp_size)]


def _all_cp_policy(groups_fn):
    def policy(lengths, costs, dp_size, cp_size, bucket_size):
        return [[_all_cp(g, cp_size) for g in groups]
                for groups in groups_fn(lengths, costs, dp_size, cp_size, bucket_size)]

    policy.__doc__ = f"{groups_fn.__doc__.splitlines()[0]} All-CP micro-batches."
    return policy


def hybrid_cp_size(length: int, cp_size: int, bucket_size: int) -> int:
    """Megatron-Core hybrid CP: ``2^ceil(log2(S / tokens_per_rank))``, at most ``cp_size``."""
    n = 1
    while n < cp_size and shard_tokens(length, n) > bucket_size:
        n *= 2
    return min(n, cp_size)


def _hybrid_sizes(lengths, cp_size: int, bucket_size: int) -> list[int]:
    """:func:`hybrid_cp_size` of every sample at once: ``[K]`` ints."""
    return hybrid_size_array(lengths, cp_size, bucket_size).tolist()


def hybrid_size_array(lengths, cp_size: int, bucket_size: int) -> np.ndarray:
    """:func:`hybrid_cp_size` of every sample at once: ``[K]`` int64."""
    s = np.asarray(lengths, dtype=np.int64)
    sizes = np.ones(s.size, dtype=np.int64)
    n = 1
    while n < cp_size:
        grow = (sizes == n) & (shard_tokens_array(s, n) > bucket_size)
        if not grow.any():
            break
        sizes[grow] = 2 * n
        n *= 2
    return np.minimum(sizes, cp_size)


def _hybrid_place(mbs, lengths, costs, i, n, cp_size, bucket_size):
    """Puts sample ``i`` on the least-loaded aligned block of ``n`` ranks that has room."""
    sh = shard_tokens(int(lengths[i]), n)
    for mb in mbs:
        best = None
        for first in range(0, cp_size - n + 1, n):
            block = range(first, first + n)
            if all(mb["rem"][r] >= sh for r in block):
                load = max(mb["load"][r] for r in block)
                if best is None or load < best[0]:
                    best = (load, first)
        if best is not None:
            for r in range(best[1], best[1] + n):
                mb["rem"][r] -= sh
                mb["load"][r] += costs[i] / n
            mb["items"].append((int(i), best[1], n))
            return True
    return False


def _new_hybrid_micro_batch(cp_size, bucket_size) -> dict:
    return {"rem": [bucket_size] * cp_size, "load": [0.0] * cp_size, "items": []}


def _hybrid_micro_batches(lengths, costs, dp_size, cp_size, bucket_size,
                          fast: bool = False) -> list[list[dict]]:
    """Each DP rank's hybrid-CP micro-batches; ``fast``: grouped by the C++ core when built."""
    groups = _cpp_groups("hybrid-cp", lengths, costs, dp_size, cp_size, bucket_size) if fast else None
    if groups is not None:
        # The same micro-batches: a sample joined the first one with room, whose state then
        # held exactly its earlier samples, so replaying each one's samples in order
        # reproduces every placement.
        out = []
        for rank in groups:
            mbs = []
            for group in rank:
                mbs.append(_new_hybrid_micro_batch(cp_size, bucket_size))
                for i in group:
                    n = hybrid_cp_size(int(lengths[i]), cp_size, bucket_size)
                    _hybrid_place(mbs[-1:], lengths, costs, i, n, cp_size, bucket_size)
            out.append(mbs)
        return out
    out = []
    for s in np.array_split(np.arange(len(lengths)), dp_size):
        mbs: list[dict] = []
        for i in sorted(s.tolist(), key=lambda i: (-costs[i], i)):
            n = hybrid_cp_size(int(lengths[i]), cp_size, bucket_size)
            if not _hybrid_place(mbs, lengths, costs, i, n, cp_size, bucket_size):
                mbs.append(_new_hybrid_micro_batch(cp_size, bucket_size))
                _hybrid_place(mbs[-1:], lengths, costs, i, n, cp_size, bucket_size)
        out.append(mbs)
    return out


def hybrid_cp(lengths, costs, dp_size, cp_size, bucket_size):
    """Megatron-Core hybrid CP: per-sequence power-of-two CP groups, greedy grouping.

    DP ranks take contiguous slices; within a rank sequences go longest-cost first into
    the first micro-batch with an aligned block of ranks that has room.  Single-rank
    placements become ``local``, full-group ones ``distributed``, the rest ``grouped``.
    """
    placed = _cpp_hybrid_items(lengths, costs, dp_size, cp_size, bucket_size)
    if placed is None:
        placed = [[mb["items"] for mb in mbs]
                  for mbs in _hybrid_micro_batches(lengths, costs, dp_size, cp_size,
                                                   bucket_size, fast=True)]
    return [[_hybrid_micro_batch(items, cp_size) for items in mbs] for mbs in placed]


def _cpp_hybrid_items(lengths, costs, dp_size, cp_size, bucket_size):
    """``(sample, first_rank, n_ranks)`` of every hybrid-CP placement, per DP rank and
    micro-batch, from the C++ core (one grouping run returns each sample with its block's
    first rank: no Python replay per sample); ``None`` without a core that has it."""
    try:
        placed = _cpp_groups("hybrid-cp-placed", lengths, costs, dp_size, cp_size, bucket_size)
    except ValueError:  # a core built before "hybrid-cp-placed" existed
        return None
    if placed is None:
        return None
    sizes = _hybrid_sizes(lengths, cp_size, bucket_size)
    return [[[(i, f, sizes[i]) for i, f in zip(g[0::2], g[1::2])] for g in rank]
            for rank in placed]


def _hybrid_micro_batch(items, cp_size) -> MicroBatch:
    dist, grouped = [], []
    local: list[list[int]] = [[] for _ in range(cp_size)]
    for i, first, n in items:
        if n == cp_size:
            dist.append(i)
        elif n == 1:
            local[first].append(i)
        else:
            grouped.append((i, first, n))
    return MicroBatch(distributed=tuple(dist), local=tuple(tuple(r) for r in local),
                      grouped=tuple(grouped))


def karmarkar_karp(weights, idx, parts: int) -> list[list[int]]:
    """Multiway largest-differencing (Karmarkar-Karp) partition of ``idx`` by ``weights``."""
    heap = []
    for order, i in enumerate(sorted(idx, key=lambda i: (-weights[i], i))):
        state = [(float(weights[i]), [int(i)])] + [(0.0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(weights[i]), order, state))
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        b = sorted(b, key=lambda x: x[0])  # smallest of b pairs with largest of a
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)),
                        key=lambda x: -x[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    if not heap:
        return [[] for _ in range(parts)]
    return [sorted(items) for _, items in heap[0][2]]


def kk_groups(lengths, costs, dp_size, cp_size, bucket_size):
    """FLOP-balanced batching (verl/slime style) without DACP.

    Karmarkar-Karp over DP ranks on the compute cost (``a S + b S^2``), then per rank the
    fewest micro-batches whose Karmarkar-Karp split fits the bucket all-CP.
    """
    out = []
    for seqs in karmarkar_karp(costs, range(len(lengths)), dp_size):
        if not seqs:
            out.append([])
            continue
        shards = {i: shard_tokens(int(lengths[i]), cp_size) for i in seqs}
        m = max(1, -(-sum(shards.values()) // bucket_size))
        while True:
            parts = [p for p in karmarkar_karp(costs, seqs, m) if p]
            if all(sum(shards[i] for i in p) <= bucket_size for p in parts):
                break
            m += 1
        out.append(parts)
    return out


def _cpp_groups(name, lengths, costs, dp_size, cp_size, bucket_size):
    """A grouping computed by the C++ core (the same answer, ``tests/test_parity.py``), or
    ``None`` without it.  Only the baseline *policies* use it (Karmarkar-Karp and hybrid CP
    in Python take seconds at GBS 4096); :data:`GROUPINGS` stay the Python reference."""
    cpp = _backend.CPP
    if cpp is None:
        return None
    return cpp.baseline_groups(np.ascontiguousarray(lengths, dtype=np.int64),
                               np.ascontiguousarray(costs, dtype=np.float64),
                               dp_size, cp_size, bucket_size, name)


def _kk_policy(lengths, costs, dp_size, cp_size, bucket_size):
    """FLOP-balanced batching (verl/slime style) without DACP. All-CP micro-batches."""
    groups = _cpp_groups("kk", lengths, costs, dp_size, cp_size, bucket_size)
    if groups is None:
        groups = kk_groups(lengths, costs, dp_size, cp_size, bucket_size)
    return [[_all_cp(g, cp_size) for g in rank] for rank in groups]


def hybrid_cp_groups(lengths, costs, dp_size, cp_size, bucket_size):
    """The samples of each :func:`hybrid_cp` micro-batch, in placement order."""
    return [[[i for i, _, _ in mb["items"]] for mb in mbs]
            for mbs in _hybrid_micro_batches(lengths, costs, dp_size, cp_size, bucket_size)]


per_seq_cp = _all_cp_policy(per_seq_cp_groups)
all_cp = _all_cp_policy(all_cp_groups)
sorted_batching = _all_cp_policy(sorted_groups)
kk_balanced = _kk_policy

# Each baseline's samples per DP rank and micro-batch (Skrull's portfolio places them).
GROUPINGS = {
    "kk": kk_groups,
    "sorted": sorted_groups,
    "all-cp": all_cp_groups,
    "per-seq-cp": per_seq_cp_groups,
    "hybrid-cp": hybrid_cp_groups,
}

BASELINES = {
    "per-seq-cp": per_seq_cp,
    "all-cp": all_cp,
    "sorted": sorted_batching,
    "hybrid-cp": hybrid_cp,
    "kk": kk_balanced,
    # Megatron-LM's packing schedulers, WLB-LLM and FlexSP (their modules say what differs).
    "dp-balanced": dp_balanced,
    "dynamic-cp": dynamic_cp,
    "wlb-llm": wlb_pack,
    # Needs SciPy (benchmark-only); takes the cost model (``wants_cost_model``).
    "flexsp": _flexsp,
}

# Policies whose dependencies are optional (benchmark-only): left out of default runs.
NEEDS_EXTRAS = {"flexsp": "scipy"}

__all__ = ["BASELINES", "GROUPINGS", "NEEDS_EXTRAS", "karmarkar_karp", "lpt_partition", "hybrid_cp_size"]
