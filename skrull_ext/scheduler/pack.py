"""(ours) The ``pack`` candidates of Skrull's portfolio: long samples packed together.

With a tight bucket and a large batch every sample longer than the bucket must be sharded
over all ``N`` CP ranks (it cannot sit whole on one), and each micro-batch holding one
pays a ring.  Spreading them over many micro-batches (GDS's interleave, the baselines'
packs) also leaves little room in each for local samples, so short samples get
distributed too, at the sharded blocks' lower efficiency.  ``pack_schedule`` instead:

1. splits the batch over the DP ranks by LPT on each sample's least work (whole cost when
   it stays local, ``N x share`` when it must be distributed);
2. per DP rank, packs the *long* samples (longer than a threshold) distributed,
   first-fit decreasing by length into as few micro-batches as their shards allow (the
   first ``m0`` micro-batches exist from the start, ``m0`` the token bound of the rank's
   samples; more open when none has room);
3. places every other sample whole, longest first, on the least-loaded (micro-batch, CP
   rank) slot with room (ties: lowest micro-batch, then CP rank), opening a micro-batch
   when no slot has room.  Loads level out across all slots, so a micro-batch's slowest
   rank is close to its mean.

The threshold is the bucket (only what must be distributed) or 95% of it
(:data:`PACK_THRESHOLDS`): a sample that alone nearly fills a rank's bucket otherwise sits
in a slot no other sample can join and sets its micro-batch's time.  ``pack-spread``
(:data:`PACK_SPREAD`) places each long sample instead on the micro-batch with the least
distributed work among those with room (ties: the lowest): every micro-batch then holds
a share of the rings and room for local work beside them, which hides the ring's
transfers (the ``paper`` objective's ``max(ring, local)``; ChatQA2 0.5B and LMSYS-Chat 7B
at CP 16, GBS 1024: Skrull's plans 3.2% and 2.0% faster).  Every CP rank stays within the
bucket: a micro-batch's shards leave ``bucket - shards`` tokens per rank, and a
local sample only goes to a slot with that much room left.

This module is the specification; ``csrc/pack.cpp`` mirrors it (``tests/test_pack.py``
checks identical plans).  The Python slot search scans every slot (clear, and fast enough
for the reference's batch sizes); C++ keeps the slots in a heap with the same tie-break.
"""
from __future__ import annotations

from typing import Sequence

from skrull_ext.scheduler.reference import Placement, _share, lpt_partition
from skrull_ext.sharding import shard_tokens

# Portfolio names -> the long-sample threshold as bucket - bucket // divisor (0: bucket).
PACK_THRESHOLDS = {"pack": 0, "pack-95": 20, "pack-spread": 0}
# Candidates that spread the long samples over the micro-batches (least distributed work).
PACK_SPREAD = ("pack-spread",)


def pack_threshold(name: str, bucket_size: int) -> int:
    """Tokens above which ``name`` distributes a sample (integer arithmetic, as C++)."""
    div = PACK_THRESHOLDS[name]
    return bucket_size - (bucket_size // div if div else 0)


def _pack_rank(lengths, costs, shares, seqs: Sequence[int], cp_size: int, bucket_size: int,
               threshold: int, spread: bool = False) -> list[Placement]:
    """Steps 2-3 for one DP rank's ``seqs``; the non-empty micro-batches in order."""
    n, cap = cp_size, bucket_size
    longs = sorted((i for i in seqs if lengths[i] > threshold), key=lambda i: (-lengths[i], i))
    shorts = sorted((i for i in seqs if lengths[i] <= threshold), key=lambda i: (-lengths[i], i))
    need = (sum(n * shard_tokens(int(lengths[i]), n) for i in longs)
            + sum(int(lengths[i]) for i in shorts))
    m0 = max(1, -(-need // (n * cap)))
    dist: list[list[int]] = [[] for _ in range(m0)]
    used = [0] * m0
    work = [0.0] * m0  # per-rank seconds of each micro-batch's distributed samples
    for i in longs:
        s = shard_tokens(int(lengths[i]), n)
        room = [k for k in range(len(dist)) if used[k] + s <= cap]
        if not room:
            k = len(dist)
        elif spread:
            k = min(room, key=lambda k: (work[k], k))
        else:
            k = room[0]
        if k == len(dist):
            dist.append([])
            used.append(0)
            work.append(0.0)
        dist[k].append(i)
        used[k] += s
        work[k] += _share(costs, shares, i, n)
    rem = [[cap - u] * n for u in used]
    load = [[0.0] * n for _ in used]
    local: list[list[list[int]]] = [[[] for _ in range(n)] for _ in used]
    for i in shorts:
        s = int(lengths[i])
        best = None
        for k in range(len(rem)):
            for r in range(n):
                if rem[k][r] >= s and (best is None or load[k][r] < load[best[0]][best[1]]):
                    best = (k, r)
        if best is None:
            dist.append([])
            rem.append([cap] * n)
            load.append([0.0] * n)
            local.append([[] for _ in range(n)])
            best = (len(rem) - 1, 0)
        k, r = best
        local[k][r].append(i)
        rem[k][r] -= s
        load[k][r] += costs[i]
    return [(dist[k], local[k]) for k in range(len(dist)) if dist[k] or any(local[k])]


def pack_schedule(lengths, costs, shares, dp_size: int, cp_size: int, bucket_size: int,
                  threshold: int, spread: bool = False) -> list[list[Placement]]:
    """``dp_size`` lists of placements (steps 1-3; not padded to equal counts).

    Args:
        lengths: ``[K]`` token lengths; every sample fits distributed.
        costs: ``[K]`` compute seconds of each sample whole on one rank.
        shares: ``[K]`` per-rank seconds of each sample distributed, or ``None``
            (``costs / N``).
        threshold: Samples longer than this are distributed; at most ``bucket_size``
            (and ``bucket_size`` when ``cp_size == 1``: nothing is distributed there).
        spread: Place each long sample on the micro-batch with room and the least
            distributed work (``pack-spread``), not the first with room.
    """
    n = cp_size
    threshold = bucket_size if n == 1 else min(threshold, bucket_size)
    work = [float(costs[i]) if lengths[i] <= threshold else n * _share(costs, shares, i, n)
            for i in range(len(lengths))]
    return [_pack_rank(lengths, costs, shares, seqs, n, bucket_size, threshold, spread)
            for seqs in lpt_partition(work, range(len(lengths)), dp_size)]


__all__ = ["PACK_SPREAD", "PACK_THRESHOLDS", "pack_schedule", "pack_threshold"]
