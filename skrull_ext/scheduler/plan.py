"""The plan type shared by every scheduling policy, the attention layout and the simulator.

(The ``python -m skrull_ext.plan`` CLI that prints and saves plans lives in :mod:`skrull_ext.plan`.)

A :class:`Plan` says, for every data-parallel (DP) rank and micro-batch, which samples of
the global batch are *distributed* (zigzag-sharded over all ``cp_size`` CP ranks) and
which are *local* (held whole by one CP rank).  The Megatron-Core hybrid-CP baseline also
uses *grouped* placements: a sample sharded over a contiguous, power-of-two sub-group of
the CP ranks (the DACP attention runs one ring per sub-group after the full ring).

Token accounting (what the bucket bounds): a local sample costs its rank ``S`` tokens; a
sample sharded over ``n > 1`` ranks is padded to a multiple of ``2n`` (zigzag chunks) and
costs each of them ``pad(S, n) / n`` tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Optional, Sequence

import numpy as np

from skrull_ext.sharding import shard_tokens, shard_tokens_array


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Placement of one micro-batch on one CP group.

    Attributes:
        distributed: Sample indices sharded over all CP ranks, in placement order.
        local: ``cp_size`` tuples; ``local[r]`` are the samples held whole by CP rank ``r``.
        grouped: ``(sample, first_rank, n_ranks)`` placements on a contiguous CP
            sub-group (hybrid CP's plans, also when Skrull keeps one as its candidate;
            empty otherwise).
    """

    distributed: tuple[int, ...]
    local: tuple[tuple[int, ...], ...]
    grouped: tuple[tuple[int, int, int], ...] = ()

    @property
    def cp_size(self) -> int:
        return len(self.local)

    def samples(self) -> list[int]:
        """Every sample index in this micro-batch (distributed, local by rank, grouped)."""
        out = list(self.distributed)
        for rank in self.local:
            out.extend(rank)
        out.extend(g[0] for g in self.grouped)
        return out

    def is_empty(self) -> bool:
        return not self.distributed and not self.grouped and not any(self.local)

    def rank_tokens(self, lengths: Sequence[int]) -> list[int]:
        """Tokens each CP rank holds, padding included: ``[cp_size]`` ints."""
        n = self.cp_size
        dist = sum(shard_tokens(lengths[i], n) for i in self.distributed)
        tokens = [dist + sum(int(lengths[i]) for i in rank) for rank in self.local]
        for i, first, size in self.grouped:
            share = shard_tokens(lengths[i], size)
            for r in range(first, first + size):
                tokens[r] += share
        return tokens

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "distributed": [int(i) for i in self.distributed],
            "local": [[int(i) for i in rank] for rank in self.local],
        }
        if self.grouped:
            out["grouped"] = [[int(x) for x in g] for g in self.grouped]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "MicroBatch":
        return cls(
            distributed=tuple(int(i) for i in obj["distributed"]),
            local=tuple(tuple(int(i) for i in rank) for rank in obj["local"]),
            grouped=tuple(tuple(int(x) for x in g) for g in obj.get("grouped", ())),
        )

    @classmethod
    def trusted(cls, distributed: tuple, local: tuple, grouped: tuple = ()) -> "MicroBatch":
        """A micro-batch from fields that already have the right types (tuples of ints,
        e.g. the C++ core's): skips the dataclass ``__init__``, ~6x faster, which counts
        for plans with thousands of micro-batches."""
        mb = object.__new__(cls)
        object.__setattr__(mb, "__dict__",
                           {"distributed": distributed, "local": local, "grouped": grouped})
        return mb

    @classmethod
    def empty(cls, cp_size: int) -> "MicroBatch":
        return cls(distributed=(), local=tuple(() for _ in range(cp_size)))


class PlanError(ValueError):
    """A plan violates an invariant (lost/duplicated sample, bucket overflow, bad shape)."""


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """Every placement of a plan as flat int64 arrays, for vectorised checks and costs.

    Micro-batches are numbered ``g = 0 .. count - 1`` over DP ranks, then micro-batches;
    CP rank ``r`` of micro-batch ``g`` is slot ``g * cp_size + r``.  Ids keep placement
    order, so per-slot sums accumulate in the same order as a walk over the plan.

    Attributes:
        count: Number of micro-batches ``G`` (all DP ranks).
        dist_ids: ``[P]`` distributed sample ids; ``dist_mb``: ``[P]`` their micro-batch.
        local_ids: ``[Q]`` local sample ids; ``local_slot``: ``[Q]`` their slot.
        grouped: ``(g, sample, first_rank, n_ranks)`` rows of grouped placements.
        verified: The C++ core already checked these placements (``skrull::plan_valid``:
            every sample once, no CP rank over the bucket; :func:`_placements_valid`).
    """

    count: int
    dist_ids: np.ndarray
    dist_mb: np.ndarray
    local_ids: np.ndarray
    local_slot: np.ndarray
    grouped: list
    verified: bool = False


def _int_array(values: list) -> Optional[np.ndarray]:
    arr = np.asarray(values) if values else np.zeros(0, dtype=np.int64)
    return arr.astype(np.int64) if arr.ndim == 1 and arr.dtype.kind in "iu" else None


def flatten_placements(dp_ranks, cp_size: int) -> Optional[FlatPlan]:
    """Flattens ``dp_ranks[d][m]`` micro-batches into a :class:`FlatPlan`.

    Returns:
        ``None`` when a micro-batch is irregular (not ``cp_size`` local lists, or
        non-integer sample ids); callers then fall back to walking the plan.
    """
    dist_ids, dist_mb, local_ids, local_slot, grouped = [], [], [], [], []
    g = 0
    for mbs in dp_ranks:
        for mb in mbs:
            if len(mb.local) != cp_size:
                return None
            if mb.distributed:
                dist_ids.extend(mb.distributed)
                dist_mb.extend([g] * len(mb.distributed))
            for r, rank in enumerate(mb.local):
                if rank:
                    local_ids.extend(rank)
                    local_slot.extend([g * cp_size + r] * len(rank))
            grouped.extend((g, *item) for item in mb.grouped)
            g += 1
    arrays = [_int_array(x) for x in (dist_ids, dist_mb, local_ids, local_slot)]
    if any(a is None for a in arrays) or not all(isinstance(x[1], (int, np.integer))
                                                 for x in grouped):
        return None
    return FlatPlan(g, *arrays, grouped)


def _token_matrix(flat: FlatPlan, lengths: np.ndarray, cp_size: int) -> np.ndarray:
    """``[G, N]`` tokens per micro-batch and CP rank (indices must be in range)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    dist = np.zeros(flat.count, dtype=np.int64)
    np.add.at(dist, flat.dist_mb, shard_tokens_array(lengths[flat.dist_ids], cp_size))
    out = np.zeros(flat.count * cp_size, dtype=np.int64)
    np.add.at(out, flat.local_slot, lengths[flat.local_ids])
    out = out.reshape(flat.count, cp_size) + dist[:, None]
    for g, i, first, size in flat.grouped:
        out[g, first:first + size] += shard_tokens(int(lengths[i]), size)
    return out


def _placements_valid(plan: "Plan") -> bool:
    """Vectorised: every sample exactly once, ids and groups in range, buckets respected.

    ``False`` means "look closer": :meth:`Plan.validate` then walks the plan to name the
    first violation.
    """
    n, k = plan.cp_size, len(plan.lengths)
    flat = plan.flat
    if flat is None:
        return False
    if flat.verified:
        return True
    if any(size < 1 or first < 0 or first + size > n for _, _, first, size in flat.grouped):
        return False
    ids = np.concatenate([flat.dist_ids, flat.local_ids,
                          np.array([x[1] for x in flat.grouped], dtype=np.int64)])
    if ids.size and (ids.min() < 0 or ids.max() >= k):
        return False
    if not np.array_equal(np.bincount(ids, minlength=k), np.ones(k, dtype=np.int64)):
        return False
    tokens = _token_matrix(flat, plan.lengths, n)
    return tokens.size == 0 or int(tokens.max()) <= plan.bucket_size


@dataclasses.dataclass(frozen=True)
class Plan:
    """Schedule of one global batch.

    Attributes:
        lengths: ``[K]`` int64 token lengths of the global batch (indices refer to these).
        dp_size: Data-parallel degree ``D``.
        cp_size: Context-parallel degree ``N``.
        bucket_size: Most tokens one CP rank may hold in one micro-batch (``C``).
        policy: Name of the policy that produced it.
        dp_ranks: ``dp_ranks[d][m]`` is the :class:`MicroBatch` ``m`` of DP rank ``d``;
            every DP rank has the same number of micro-batches (empty ones pad).
        predicted: Cost-model predictions (seconds), filled by the scheduler.
    """

    lengths: np.ndarray
    dp_size: int
    cp_size: int
    bucket_size: int
    policy: str
    dp_ranks: tuple[tuple[MicroBatch, ...], ...]
    predicted: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_micro_batches(self) -> int:
        return len(self.dp_ranks[0]) if self.dp_ranks else 0

    @functools.cached_property
    def flat(self) -> Optional[FlatPlan]:
        """:func:`flatten_placements` of this plan, computed once (validation, prediction
        and token counts all walk it; the plan is immutable)."""
        return flatten_placements(self.dp_ranks, self.cp_size)

    def micro_batch(self, dp_rank: int, index: int) -> MicroBatch:
        return self.dp_ranks[dp_rank][index]

    def rank_tokens(self) -> np.ndarray:
        """``[D, M, N]`` tokens held per DP rank, micro-batch and CP rank (padding included)."""
        flat = self.flat
        if (flat is not None and len(self.dp_ranks) == self.dp_size
                and len({len(mbs) for mbs in self.dp_ranks}) <= 1
                and all(0 <= f and f + n <= self.cp_size for _, _, f, n in flat.grouped)):
            shape = (self.dp_size, self.num_micro_batches, self.cp_size)
            return _token_matrix(flat, self.lengths, self.cp_size).reshape(shape)
        out = np.zeros((self.dp_size, self.num_micro_batches, self.cp_size), dtype=np.int64)
        for d, mbs in enumerate(self.dp_ranks):
            for m, mb in enumerate(mbs):
                out[d, m] = mb.rank_tokens(self.lengths)
        return out

    def local_token_share(self) -> float:
        """Share of the global batch's (unpadded) tokens that are kept local."""
        total = int(np.sum(self.lengths))
        local = sum(
            int(self.lengths[i]) for mbs in self.dp_ranks for mb in mbs for r in mb.local for i in r
        )
        return local / total if total else 0.0

    def validate(self) -> None:
        """Checks every invariant; raises :class:`PlanError` naming the first violation.

        Each sample appears exactly once; every DP rank has the same number of
        micro-batches; every micro-batch has ``cp_size`` local lists; grouped placements
        stay inside the CP group; no CP rank holds more than ``bucket_size`` tokens.
        """
        k = len(self.lengths)
        if len(self.dp_ranks) != self.dp_size:
            raise PlanError(f"plan has {len(self.dp_ranks)} DP ranks, expected {self.dp_size}")
        counts = {len(mbs) for mbs in self.dp_ranks}
        if len(counts) > 1:
            raise PlanError(f"DP ranks run different micro-batch counts {sorted(counts)}")
        if _placements_valid(self):  # fast path; otherwise walk the plan to name the fault
            return
        seen = np.zeros(k, dtype=np.int64)
        for d, mbs in enumerate(self.dp_ranks):
            for m, mb in enumerate(mbs):
                if mb.cp_size != self.cp_size:
                    raise PlanError(f"dp {d} mb {m}: {mb.cp_size} local lists, cp_size {self.cp_size}")
                for i, first, size in mb.grouped:
                    if size < 1 or first < 0 or first + size > self.cp_size:
                        raise PlanError(f"dp {d} mb {m}: group ({first}, {size}) outside CP group")
                for i in mb.samples():
                    if not 0 <= i < k:
                        raise PlanError(f"dp {d} mb {m}: sample index {i} out of range [0, {k})")
                    seen[i] += 1
                tokens = mb.rank_tokens(self.lengths)
                worst = int(np.argmax(tokens))
                if tokens[worst] > self.bucket_size:
                    raise PlanError(
                        f"dp {d} mb {m}: CP rank {worst} holds {tokens[worst]} tokens "
                        f"> bucket size {self.bucket_size}"
                    )
        missing = np.flatnonzero(seen == 0)
        if missing.size:
            raise PlanError(f"samples never scheduled: {missing[:10].tolist()}")
        dup = np.flatnonzero(seen > 1)
        if dup.size:
            raise PlanError(f"samples scheduled more than once: {dup[:10].tolist()}")

    def to_json(self) -> dict[str, Any]:
        """The plan CLI's JSON contract (docs/scheduler.md, "Plan one global batch")."""
        return {
            "config": {
                "dp_size": self.dp_size,
                "cp_size": self.cp_size,
                "bucket_size": self.bucket_size,
                "policy": self.policy,
                "num_samples": len(self.lengths),
                "lengths": [int(x) for x in self.lengths],
            },
            "num_micro_batches": self.num_micro_batches,
            "dp_ranks": [
                {"micro_batches": [mb.to_json() for mb in mbs]} for mbs in self.dp_ranks
            ],
            "predicted": self.predicted,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Plan":
        cfg = obj["config"]
        return cls(
            lengths=np.asarray(cfg["lengths"], dtype=np.int64),
            dp_size=int(cfg["dp_size"]),
            cp_size=int(cfg["cp_size"]),
            bucket_size=int(cfg["bucket_size"]),
            policy=str(cfg["policy"]),
            dp_ranks=tuple(
                tuple(MicroBatch.from_json(mb) for mb in rank["micro_batches"])
                for rank in obj["dp_ranks"]
            ),
            predicted=dict(obj.get("predicted", {})),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())

