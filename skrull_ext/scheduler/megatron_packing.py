"""Megatron-LM's sequence-packing schedulers, re-implemented as baselines (never imports megatron).

Source: NVIDIA/Megatron-LM, branch ``dev`` at d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1
(2026-08-21): ``megatron/core/datasets/data_schedule.py`` (``DpBalancedScheduler``,
``DefaultDynamicCPScheduler``) and ``megatron/core/datasets/data_schedule_utils.py``
(``next_hdp_group_packing_aware``, ``dcp_gpus_needed``).  Read there, rewritten here on our
plan type; ``--max-seqlen-per-dp-cp-rank`` is our bucket.

**dp_balanced** (:func:`dp_balanced_groups`): next-fit packing in the global batch's order
while a pack's padded lengths stay within ``bucket x N``; then packs are split off the end
(the last sample of the last pack with more than one) until their number is a multiple of
``D``; micro-batch ``i`` of DP rank ``d`` is pack ``i D + d``, every sample sharded over the
whole CP group.

**default_dynamic_cp** (:func:`dynamic_cp_world`): over the ``D x N`` ranks of the DP x CP
world, micro-batch after micro-batch, longest sample first: the first sample opens a CP
group of ``dcp_gpus_needed`` ranks (the next power of two of ``S / bucket``); each next one
joins an existing group of some power-of-two size ``g >= its need`` whose per-rank packed
length stays within the bucket, or opens a new group on the lowest free ranks, whichever
gives the lowest largest per-rank workload (``S^2 / g`` summed), as long as that stays within
``1.05 x tallest x bucket``; a sample that fits nowhere waits for the next micro-batch.
Ranks left empty are filled by doubling the smallest group (shifting the groups behind it)
or, when that cannot, by one group over the whole world (a greedy re-selection).

Differences (ours), all written down:

* Lengths: Megatron schedules ``padded_seq_len`` (padded to ``2 N``, dynamic CP ``2 D N``,
  after the mock dataset's shift by one token); we pad every length to a multiple of
  ``2 x block`` for the decisions (``block``: see below; ``= D N`` exactly as Megatron
  when groups may span the world; for a non-power-of-two block, also of twice its
  largest power of two) and count a plan's tokens with our zigzag padding, which is never
  more, so a plan is always within the bucket.
* Order: Megatron's global order is the DP-rank-major gather of what each rank's sampler
  drew, a permutation of the batch; we take the batch in index order (``dp_balanced``
  packs in that order; dynamic CP sorts anyway, stably, ties by index as Megatron's
  stable sort keeps them).
* ``dp_balanced`` with fewer packs than ``D`` that cannot be split (Megatron asserts "Not
  enough samples to move"): the ranks without a pack get empty micro-batches.
* Dynamic CP groups across DP replicas: Megatron's groups may span several DP replicas'
  CP groups (its world is ``D x N`` ranks); our plans hold CP groups inside one replica.
  :func:`dynamic_cp_world` runs Megatron's rule on a world cut into blocks of ``block``
  ranks: with ``block = D N`` (one block) it is Megatron's; the baseline policy
  (:func:`dynamic_cp`) uses ``block = N``: a group stays in one replica (at most ``N``
  ranks), a new group takes the lowest free ranks of the first replica that has enough,
  and each replica's empty ranks are filled by Megatron's doubling inside the replica (or
  one group over the replica, re-selected from that replica's samples).  With ``D = 1``
  both are Megatron's.  The planner's Megatron benchmark
  (``benchmarks/megatron_dynamic_cp.py``) runs the world version as a plan over one
  replica of ``D x N`` ranks.
* Non-power-of-two ``block``: the need is capped at ``block`` (Megatron's CP groups are
  powers of two).  ``min_dynamic_context_parallel_size`` is 1 and VPP alignment and
  ``max_num_seqs`` are not modelled (the benchmark's defaults).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.sharding import shard_tokens

# data_schedule_utils._DYNAMIC_CP_WORKLOAD_CAP_DELTA at the commit above.
WORKLOAD_CAP_DELTA = 0.05


def _padded(length: int, multiple: int) -> int:
    return -(-int(length) // multiple) * multiple


def dp_balanced_groups(lengths, costs, dp_size, cp_size, bucket_size) -> list[list[list[int]]]:
    """``DpBalancedScheduler``'s packs: ``[D][M]`` sample lists (see the module doc)."""
    cap = bucket_size * cp_size
    mult = 2 * cp_size if cp_size > 1 else 1
    packs: list[list[int]] = []
    used = 0
    for i, s in enumerate(lengths):
        s = _padded(int(s), mult)
        if packs and used + s <= cap:
            packs[-1].append(i)
            used += s
        else:
            packs.append([i])
            used = s
    missing = -len(packs) % dp_size
    j = len(packs) - 1
    while missing and j >= 0:  # split the last multi-sample packs
        if len(packs[j]) > 1:
            packs.append([packs[j].pop()])
            missing -= 1
        else:
            j -= 1
    return [packs[d::dp_size] for d in range(dp_size)]


def dp_balanced(lengths, costs, dp_size, cp_size, bucket_size):
    """Megatron-LM ``dp_balanced``: next-fit packs dealt round-robin, all-CP micro-batches."""
    return [[MicroBatch(distributed=tuple(p), local=((),) * cp_size) for p in rank]
            for rank in dp_balanced_groups(lengths, costs, dp_size, cp_size, bucket_size)]


def cp_needed(length: int, bucket_size: int, limit: int) -> int:
    """``dcp_gpus_needed``: the next power of two of ``length / bucket`` (at least 1), at
    most ``limit`` (ours, for non-power-of-two blocks)."""
    return min(max(1, 2 ** math.ceil(math.log2(length / bucket_size))), limit)


class _Round:
    """The state of one micro-batch of :func:`dynamic_cp_world` over ``total`` ranks."""

    def __init__(self, total: int, block: int):
        self.total, self.block = total, block
        self.first_free = list(range(0, total, block))  # per block: ranks below are taken
        self.lens = [[] for _ in range(total)]   # per rank: the lengths it holds
        self.work = [0.0] * total                # per rank: sum of S^2 / g
        self.ids = [[] for _ in range(total)]    # per rank: the sample ids it holds
        self.group_of: list = [None] * total     # per rank: its group id
        self.members: dict[int, list[int]] = {}  # group id -> ranks (creation order)
        self.packed: dict[int, float] = {}       # group id -> per-rank packed length

    def add(self, gid: int, ranks: list[int], sid: int, s: int) -> None:
        size = len(ranks)
        if gid not in self.members:
            self.members[gid] = ranks
            self.packed[gid] = 0.0
            for r in ranks:
                self.group_of[r] = gid
            b = ranks[0] // self.block  # new groups take a block's lowest free ranks
            self.first_free[b] = max(self.first_free[b], ranks[-1] + 1)
        self.packed[gid] += s / size
        w = s * s / size
        for r in ranks:
            self.lens[r].append(s)
            self.work[r] += w
            self.ids[r].append(sid)

    def projected(self, ranks, w: float) -> float:
        on = set(ranks)
        return max(t + w if r in on else t for r, t in enumerate(self.work))


def _place(rnd: _Round, sid: int, s: int, bucket: int, block: int, cap: float):
    """Megatron's choice for one sample: ``(size, gid or None, ranks)`` or ``None``."""
    best = None
    g = cp_needed(s, bucket, block)
    while g <= block:
        w = s * s / g
        for gid, ranks in rnd.members.items():  # join an existing group of size g
            if len(ranks) != g or rnd.packed[gid] + s / g > bucket:
                continue
            t = rnd.projected(ranks, w)
            if t <= cap and (best is None or t < best[0]):
                best = (t, gid, ranks)
        for b, lo in enumerate(rnd.first_free):  # open one on the lowest free ranks
            if (b + 1) * block - lo >= g:
                ranks = list(range(lo, lo + g))
                t = rnd.projected(ranks, w)
                if t <= cap and (best is None or t < best[0]):
                    best = (t, None, ranks)
                break
        g *= 2
    return best


def _fill_block(rnd: _Round, lo: int, hi: int) -> bool:
    """Megatron's ``fill_empty_gpus_once`` on ranks ``[lo, hi)``: doubles the first group
    of the smallest size that has room, shifting the groups behind it; ``False`` when none
    can (or nothing is empty)."""
    empty = [r for r in range(lo, hi) if not rnd.lens[r]]
    groups = {gid: m for gid, m in rnd.members.items() if lo <= m[0] < hi}
    if not empty or not groups:
        return False
    smallest = min(len(m) for m in groups.values())
    double = min(smallest * 2, hi - lo)
    for gid, ranks in groups.items():
        if len(ranks) != smallest:
            continue
        first, last, extra = ranks[0], ranks[-1], double - smallest
        # (ours: the last test) the ranks pushed right must stay in [lo, hi); Megatron's
        # indexing fails there, which only non-power-of-two worlds reach.
        if last + 1 > empty[0] or last + extra >= hi or empty[0] + extra > hi:
            continue
        lens, ids = list(rnd.lens[last]), list(rnd.ids[last])
        moved = [(rnd.lens[r], rnd.work[r], rnd.ids[r]) for r in range(last + 1, empty[0])]
        for r in range(first, last + extra + 1):
            rnd.lens[r], rnd.ids[r] = list(lens), list(ids)
            rnd.work[r] = sum(x * x / double for x in lens)
        for k, (a, b, c) in enumerate(moved):
            rnd.lens[last + extra + 1 + k], rnd.work[last + extra + 1 + k] = a, b
            rnd.ids[last + extra + 1 + k] = c
        for other, m in groups.items():
            if other != gid and m[0] > last:
                rnd.members[other] = [r + extra for r in m]
        rnd.members[gid] = list(range(first, last + extra + 1))
        return True
    return False


def _fill_whole(rnd: _Round, lo: int, hi: int, pool, bucket: int) -> list:
    """Megatron's ``fill_with_full_dpxcp_group`` on ranks ``[lo, hi)``: one group over
    them, greedily re-selected from ``pool``'s ``(id, padded length)`` in order; returns
    the rest (the next micro-batch's)."""
    size, packed, chosen, rest = hi - lo, 0.0, [], []
    for sid, s in pool:
        if packed + s / size <= bucket:
            chosen.append((sid, s))
            packed += s / size
        else:
            rest.append((sid, s))
    for r in range(lo, hi):
        rnd.lens[r] = [s for _, s in chosen]
        rnd.ids[r] = [sid for sid, _ in chosen]
        rnd.work[r] = sum(s * s / size for _, s in chosen)
    for gid in [g for g, m in rnd.members.items() if lo <= m[0] < hi]:
        del rnd.members[gid]
    rnd.members[-1 - lo] = list(range(lo, hi))
    return rest


def _next_micro_batch(pool, total: int, block: int, bucket: int):
    """``next_hdp_group_packing_aware`` on blocks of ``block`` ranks: ``(round, rest)``."""
    pool = sorted(pool, key=lambda x: -x[1])  # stable: equal lengths keep their order
    rnd = _Round(total, block)
    sid, s = pool[0]
    rnd.add(0, list(range(cp_needed(s, bucket, block))), sid, s)
    cap = float(s) * float(bucket) * (1.0 + WORKLOAD_CAP_DELTA)
    rest, next_gid = [], 1
    for q in range(1, len(pool)):
        sid, s = pool[q]
        best = _place(rnd, sid, s, bucket, block, cap)
        if best is None:
            rest.append((sid, s))
            continue
        _, gid, ranks = best
        if gid is None:
            gid, next_gid = next_gid, next_gid + 1
        rnd.add(gid, ranks, sid, s)
        # (ours, the same plan, O(K) fewer tries per round) Once the pool's smallest sample
        # fits nowhere, none of the rest does: a longer sample has fewer group sizes, more
        # work and more packed tokens to fit, and adds only raise work, packing and the
        # first free ranks (a group opened later sits on ranks free, at work 0, before).
        if _place(rnd, pool[-1][0], pool[-1][1], bucket, block, cap) is None:
            rest += pool[q + 1:]
            break
    for lo in range(0, total, block):
        while any(not rnd.lens[r] for r in range(lo, lo + block)):
            if _fill_block(rnd, lo, lo + block):
                continue
            if block == total:  # Megatron: re-selected from the whole call's samples
                return rnd, _fill_whole(rnd, 0, total, pool, bucket)
            mine = {i for r in range(lo, lo + block) for i in rnd.ids[r]}
            rest += _fill_whole(rnd, lo, lo + block, [x for x in pool if x[0] in mine], bucket)
            break
    return rnd, rest


def dynamic_cp_world(lengths, dp_size: int, cp_size: int, bucket_size: int,
                     block: int) -> list[list[tuple[int, int, tuple[int, ...]]]]:
    """``DefaultDynamicCPScheduler`` on ``D x N`` ranks cut into blocks of ``block``.

    Returns:
        Per micro-batch, its groups ``(first_rank, size, sample ids)`` over world ranks
        (``block = D N``: Megatron's own rule; ``block = N``: groups inside DP replicas).
    """
    total = dp_size * cp_size
    # Megatron pads to 2 x world; a multiple of 2 g for every group size g (powers of two
    # up to the block, and the block) keeps its packing test within our zigzag tokens.
    mult = math.lcm(2 * block, 2 * (1 << (block.bit_length() - 1))) if block > 1 else 1
    pool = [(i, _padded(int(s), mult)) for i, s in enumerate(lengths)]
    out = []
    while pool:
        rnd, pool = _next_micro_batch(pool, total, block, bucket_size)
        groups, r = [], 0
        while r < total:
            size = 1
            while r + size < total and rnd.ids[r + size] == rnd.ids[r]:
                size += 1
            if rnd.ids[r]:
                groups.append((r, size, tuple(rnd.ids[r])))
            r += size
        out.append(groups)
    return out


def world_micro_batch(groups, cp_size: int, first_rank: int = 0) -> MicroBatch:
    """The groups ``(first, size, ids)`` of one replica (ranks ``[first_rank, first_rank +
    cp_size)``) as a :class:`MicroBatch`: size 1 local, ``cp_size`` distributed, else grouped."""
    local: list[list[int]] = [[] for _ in range(cp_size)]
    dist, grouped = [], []
    for first, size, ids in groups:
        off = first - first_rank
        if size == cp_size:
            dist.extend(ids)
        elif size == 1:
            local[off].extend(ids)
        else:
            grouped.extend((i, off, size) for i in ids)
    return MicroBatch(distributed=tuple(dist), local=tuple(map(tuple, local)),
                      grouped=tuple(grouped))


def dynamic_cp(lengths, costs, dp_size, cp_size, bucket_size):
    """Megatron-LM ``default_dynamic_cp``: per-sample power-of-two CP groups balanced over
    the DP x CP ranks, one micro-batch at a time (groups kept inside DP replicas)."""
    ranks: list[list[MicroBatch]] = [[] for _ in range(dp_size)]
    for groups in dynamic_cp_world(lengths, dp_size, cp_size, bucket_size, cp_size):
        for d in range(dp_size):
            mine = [g for g in groups if d * cp_size <= g[0] < (d + 1) * cp_size]
            ranks[d].append(world_micro_batch(mine, cp_size, d * cp_size))
    return ranks


def shard_check(groups: Sequence, lengths, bucket_size: int) -> bool:
    """Whether no rank of a world micro-batch holds more than the bucket (zigzag tokens)."""
    load: dict[int, int] = {}
    for first, size, ids in groups:
        tok = sum(int(lengths[i]) if size == 1 else shard_tokens(int(lengths[i]), size)
                  for i in ids)
        for r in range(first, first + size):
            load[r] = load.get(r, 0) + tok
    return max(load.values(), default=0) <= bucket_size


__all__ = ["cp_needed", "dp_balanced", "dp_balanced_groups", "dynamic_cp", "dynamic_cp_world",
           "shard_check", "world_micro_batch"]
