"""What one CP rank holds of a micro-batch, as one packed token stream (THD layout).

Given a micro-batch's placement (see :class:`skrull_ext.scheduler.plan.MicroBatch`), CP rank ``r``
of ``N`` holds

* its *local* sequences whole, in the order of ``local[r]``, then
* its zigzag shard of every *distributed* sequence, in the order of ``distributed``.

A distributed sequence of ``S`` tokens is padded to ``P = pad(S, N)`` (a multiple of
``2 N``) and cut into ``2 N`` chunks of ``c = P / (2 N)`` tokens; rank ``r`` holds chunks
``r`` and ``2 N - 1 - r`` (in that order), so every rank holds ``2 c`` tokens of it and the
causal work is balanced.  With ``N == 1`` a distributed sequence is simply held whole
(no padding, no chunks).  Padding sits at the end of a sequence, so under causal
masking no real token ever attends to a padding token.

Position ids restart at 0 for every sequence; a shard keeps its global positions
(padding tokens continue the numbering past ``S``).  The same layout splits token ids,
labels and loss masks for the data pipeline (:func:`pack_samples`), packs activations
(:meth:`RankLayout.pack`) and scatters outputs back (:meth:`RankLayout.unpack`).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Callable, Mapping, Sequence, TypeVar, Union

import torch

from skrull_ext.attention.staging import device_key
from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.sharding import padded_length

PerSample = Union[Sequence[torch.Tensor], Mapping[int, torch.Tensor]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedDoc:
    """This rank's shard of one distributed sequence.

    Attributes:
        sample: Sample id (index into ``lengths``).
        length: Real tokens of the sequence ``S``.
        padded_length: ``pad(S, N)``; equals ``S`` when ``cp_size == 1``.
        chunk_size: Zigzag chunk ``c = padded_length / (2 N)``; 0 when ``cp_size == 1``
            (the sequence is held whole, there are no chunks).
        offset: Start of the shard in the packed stream.
        shard_length: Tokens of the shard in the stream (``2 c``, or ``S`` when N == 1).
    """

    sample: int
    length: int
    padded_length: int
    chunk_size: int
    offset: int
    shard_length: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """A contiguous run of the packed stream: ``[start, stop)`` of a sample, then padding."""

    sample: int
    start: int
    stop: int
    num_padding: int
    position: int  # global position of the run's first token


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubGroupPart:
    """This rank's shards of the grouped sequences of one CP sub-group (one ring).

    Attributes:
        first_rank: First CP rank of the sub-group.
        size: Ranks in the sub-group ``n`` (the ring runs over CP ranks
            ``first_rank .. first_rank + n - 1``).
        offset: Start of the part in the packed stream.
        docs: :class:`DistributedDoc` per sequence (this rank's zigzag shard, as rank
            ``cp_rank - first_rank`` of ``n``), in placement order.
        cu_seqlens: ``[len(docs) + 1]`` shard offsets relative to :attr:`offset`; the
            same on every rank of the sub-group (fixed-shape ring messages).
    """

    first_rank: int
    size: int
    offset: int
    docs: tuple[DistributedDoc, ...]
    cu_seqlens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RankLayout:
    """One CP rank's packed stream of a micro-batch.

    Stream order: local sequences of this rank (in ``local[cp_rank]`` order), then the
    shards of the distributed sequences (in ``distributed`` order), then one part per CP
    sub-group this rank belongs to (:attr:`groups`).

    Attributes:
        cp_rank: This rank in the CP group.
        cp_size: CP group size ``N``.
        num_tokens: ``T``, tokens this rank holds (padding included).
        local_samples: Sample ids of the local sequences, in stream order.
        local_cu_seqlens: ``[len(local_samples) + 1]`` stream offsets of the local docs
            (starts at 0; the last entry is :attr:`num_local_tokens`).
        distributed: :class:`DistributedDoc` per distributed sequence, in stream order.
        dist_cu_seqlens: ``[len(distributed) + 1]`` offsets of the shards *relative to the
            start of the distributed part* (:attr:`num_local_tokens`).
        segments: Contiguous runs of the stream (for packing).
        position_ids: ``[T]`` int64 global positions (restart at 0 per sequence).
        is_padding: ``[T]`` bool, True on zigzag padding tokens.
        sample_ids: ``[T]`` int64 source sample id, -1 on padding.
        token_index: ``[T]`` int64 index of the token within its sample, -1 on padding.
        groups: :class:`SubGroupPart` per CP sub-group holding this rank (hybrid-CP
            grouped placements), ordered by ``(first_rank, size)``; empty without them.
    """

    cp_rank: int
    cp_size: int
    num_tokens: int
    local_samples: tuple[int, ...]
    local_cu_seqlens: tuple[int, ...]
    distributed: tuple[DistributedDoc, ...]
    dist_cu_seqlens: tuple[int, ...]
    segments: tuple[Segment, ...]
    position_ids: torch.Tensor
    is_padding: torch.Tensor
    sample_ids: torch.Tensor
    token_index: torch.Tensor
    groups: tuple[SubGroupPart, ...] = ()

    @property
    def num_local_tokens(self) -> int:
        """Tokens of the local part (the first ones of the stream)."""
        return self.local_cu_seqlens[-1]

    @property
    def num_distributed_tokens(self) -> int:
        """Tokens of the distributed part; identical on every rank of the CP group."""
        return self.dist_cu_seqlens[-1]

    @property
    def grouped_docs(self) -> tuple[DistributedDoc, ...]:
        """This rank's grouped shards, in stream order (every sub-group part)."""
        return tuple(d for part in self.groups for d in part.docs)

    @property
    def samples(self) -> tuple[int, ...]:
        """Every sample this rank holds tokens of, in stream order."""
        return (self.local_samples + tuple(d.sample for d in self.distributed)
                + tuple(d.sample for d in self.grouped_docs))

    @functools.cached_property
    def _sample_lengths(self) -> dict[int, int]:
        out = {}
        for s, ln in zip(self.local_samples, _diffs(self.local_cu_seqlens)):
            out[s] = ln
        for d in self.distributed + self.grouped_docs:
            out[d.sample] = d.length
        return out

    def pack(self, per_sample: PerSample, *, fill: float | int = 0) -> torch.Tensor:
        """Gathers this rank's tokens of per-sample tensors into the packed stream.

        Differentiable (slices and ``torch.cat``).

        Args:
            per_sample: Indexable by sample id (a sequence over all samples, or a mapping
                holding at least this rank's samples); each ``[S_i, ...]``.
            fill: Value of the padding rows.

        Returns:
            ``[T, ...]`` tensor; padding rows hold ``fill``.  When this rank holds no
            tokens the result is empty, shaped like the first given tensor (a 1-D
            float tensor if ``per_sample`` is empty).
        """
        parts = []
        proto = None
        for seg in self.segments:
            x = _lookup(per_sample, seg.sample)
            want = self._sample_lengths[seg.sample]
            if x.shape[0] != want:
                raise ValueError(
                    f"sample {seg.sample} has {x.shape[0]} rows but the layout was built with "
                    f"length {want}; pass the same lengths to build_rank_layout"
                )
            proto = x
            if seg.stop > seg.start:
                parts.append(x[seg.start:seg.stop])
            if seg.num_padding:
                parts.append(x.new_full((seg.num_padding,) + tuple(x.shape[1:]), fill))
        if proto is None:
            return _empty_like_any(per_sample)
        return torch.cat(parts, dim=0)

    def unpack(self, packed: torch.Tensor) -> dict[int, torch.Tensor]:
        """Scatters a packed tensor back to per-sample tensors (inverse of :meth:`pack`).

        Differentiable.  Local samples come back complete; a distributed sample comes
        back full length with zeros in the rows other ranks hold, so summing the results
        of all CP ranks reconstructs it.  Padding rows are dropped.

        Args:
            packed: ``[T, ...]``.

        Returns:
            ``{sample_id: [S_i, ...]}`` for every sample in :attr:`samples`.
        """
        if packed.shape[0] != self.num_tokens:
            raise ValueError(f"packed tensor has {packed.shape[0]} rows, layout holds {self.num_tokens}")
        rest = tuple(packed.shape[1:])
        pos = 0
        pieces: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for seg in self.segments:
            n = seg.stop - seg.start
            pieces.setdefault(seg.sample, []).append((seg.start, packed[pos:pos + n]))
            pos += n + seg.num_padding
        out = {}
        for s, runs in pieces.items():
            length = self._sample_lengths[s]
            if len(runs) == 1 and runs[0][1].shape[0] == length:
                out[s] = runs[0][1]
                continue
            idx = torch.cat([torch.arange(a, a + r.shape[0]) for a, r in runs]).to(packed.device)
            src = torch.cat([r for _, r in runs], dim=0)
            out[s] = packed.new_zeros((length,) + rest).index_copy(0, idx, src)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PackedSamples:
    """This rank's packed inputs for the data pipeline, all ``[T]``.

    Attributes:
        tokens: Token ids (``pad_token_id`` on padding).
        labels: Labels (``pad_label`` on padding), or None when no labels were given.
        loss_mask: float32 loss mask; 0 on padding.
        position_ids: Global positions (restart at 0 per sequence).
        is_padding: True on zigzag padding.
    """

    tokens: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    is_padding: torch.Tensor


def build_rank_layout(
    lengths: Sequence[int],
    distributed: Sequence[int],
    local: Sequence[Sequence[int]],
    cp_rank: int,
    cp_size: int,
    grouped: Sequence[tuple[int, int, int]] = (),
) -> RankLayout:
    """Builds what CP rank ``cp_rank`` holds of one micro-batch.

    Args:
        lengths: Token length per sample id (>= 1 for every sample used).
        distributed: Sample ids sharded over all ``cp_size`` ranks, in placement order.
        local: ``cp_size`` sequences; ``local[r]`` are the sample ids held whole by rank r.
        cp_rank: This rank, ``0 <= cp_rank < cp_size``.
        cp_size: CP group size ``N >= 1``.
        grouped: ``(sample, first_rank, n_ranks)`` placements on CP sub-groups
            (:attr:`MicroBatch.grouped <skrull_ext.scheduler.plan.MicroBatch.grouped>`).

    Returns:
        The :class:`RankLayout` (local sequences, the distributed shards, then the
        grouped shards of this rank's sub-groups).

    Raises:
        ValueError: On an out-of-range rank, sample or sub-group, a sample placed twice,
            a non-positive length, or ``len(local) != cp_size``.
    """
    _validate(lengths, distributed, local, cp_rank, cp_size, grouped)
    segments: list[Segment] = []
    local_samples = tuple(int(s) for s in local[cp_rank])
    local_cu = [0]
    for s in local_samples:
        n = int(lengths[s])
        segments.append(Segment(sample=s, start=0, stop=n, num_padding=0, position=0))
        local_cu.append(local_cu[-1] + n)
    docs, dist_cu = [], [0]
    for s in distributed:
        s = int(s)
        doc, segs = _shard(s, int(lengths[s]), cp_rank, cp_size, local_cu[-1] + dist_cu[-1])
        docs.append(doc)
        segments.extend(segs)
        dist_cu.append(dist_cu[-1] + doc.shard_length)
    groups = _group_parts(lengths, grouped, cp_rank, local_cu[-1] + dist_cu[-1], segments)
    per_token = _per_token(segments)
    return RankLayout(
        cp_rank=cp_rank,
        cp_size=cp_size,
        num_tokens=local_cu[-1] + dist_cu[-1] + sum(g.num_tokens for g in groups),
        local_samples=local_samples,
        local_cu_seqlens=tuple(local_cu),
        distributed=tuple(docs),
        dist_cu_seqlens=tuple(dist_cu),
        segments=tuple(segments),
        groups=groups,
        **per_token,
    )


def _group_parts(lengths, grouped, cp_rank, offset, segments) -> tuple[SubGroupPart, ...]:
    """This rank's :class:`SubGroupPart` s (appending their segments to ``segments``)."""
    members: dict[tuple[int, int], list[int]] = {}
    for s, first, n in grouped:
        if first <= cp_rank < first + n:
            members.setdefault((int(first), int(n)), []).append(int(s))
    parts = []
    for (first, n), samples in sorted(members.items()):
        docs, cu = [], [0]
        for s in samples:
            doc, segs = _shard(s, int(lengths[s]), cp_rank - first, n, offset + cu[-1])
            docs.append(doc)
            segments.extend(segs)
            cu.append(cu[-1] + doc.shard_length)
        parts.append(SubGroupPart(first_rank=first, size=n, offset=offset, docs=tuple(docs),
                                  cu_seqlens=tuple(cu)))
        offset += cu[-1]
    return tuple(parts)


def layout_for_micro_batch(mb: MicroBatch, lengths: Sequence[int], cp_rank: int) -> RankLayout:
    """:func:`build_rank_layout` for a :class:`~skrull_ext.scheduler.plan.MicroBatch`
    (grouped placements included)."""
    return build_rank_layout(lengths, mb.distributed, mb.local, cp_rank, mb.cp_size, mb.grouped)


def pack_samples(
    layout: RankLayout,
    tokens: PerSample,
    labels: PerSample | None = None,
    loss_mask: PerSample | None = None,
    *,
    pad_token_id: int = 0,
    pad_label: int = 0,
) -> PackedSamples:
    """Splits per-sample 1-D token ids / labels / loss masks into this rank's stream.

    Args:
        layout: This rank's layout.
        tokens: Per-sample ``[S_i]`` token ids (sequence over all samples or mapping).
        labels: Per-sample ``[S_i]`` labels, optional.
        loss_mask: Per-sample ``[S_i]`` loss masks; None means 1 on every real token.
        pad_token_id: Token id of padding tokens.
        pad_label: Label of padding tokens (masked out by the loss mask anyway).

    Returns:
        :class:`PackedSamples` with ``[T]`` tensors; the loss mask is 0 on padding.
    """
    packed_tokens = layout.pack(tokens, fill=pad_token_id)
    packed_labels = None if labels is None else layout.pack(labels, fill=pad_label)
    if loss_mask is None:
        mask = (~layout.is_padding).to(torch.float32)
    else:
        mask = layout.pack(loss_mask, fill=0).to(torch.float32)
    return PackedSamples(
        tokens=packed_tokens,
        labels=packed_labels,
        loss_mask=mask,
        position_ids=layout.position_ids.clone(),
        is_padding=layout.is_padding.clone(),
    )


def _shard(sample, length, rank, n, offset):
    if n == 1:
        doc = DistributedDoc(sample=sample, length=length, padded_length=length,
                             chunk_size=0, offset=offset, shard_length=length)
        return doc, [Segment(sample=sample, start=0, stop=length, num_padding=0, position=0)]
    padded = padded_length(length, n)
    c = padded // (2 * n)
    segs = []
    for chunk in (rank, 2 * n - 1 - rank):
        lo = chunk * c
        start, stop = min(lo, length), min(lo + c, length)
        segs.append(Segment(sample=sample, start=start, stop=stop,
                            num_padding=c - (stop - start), position=lo))
    doc = DistributedDoc(sample=sample, length=length, padded_length=padded,
                         chunk_size=c, offset=offset, shard_length=2 * c)
    return doc, segs


def _per_token(segments):
    pos, pad, sid, tidx = [], [], [], []
    for seg in segments:
        n = seg.stop - seg.start
        total = n + seg.num_padding
        pos.append(torch.arange(seg.position, seg.position + total, dtype=torch.int64))
        flag = torch.zeros(total, dtype=torch.bool)
        flag[n:] = True
        pad.append(flag)
        sid.append(torch.full((total,), seg.sample, dtype=torch.int64).masked_fill(flag, -1))
        tidx.append(torch.arange(seg.start, seg.start + total, dtype=torch.int64).masked_fill(flag, -1))
    if not segments:
        empty = torch.zeros(0, dtype=torch.int64)
        return dict(position_ids=empty, is_padding=empty.bool(), sample_ids=empty.clone(),
                    token_index=empty.clone())
    return dict(position_ids=torch.cat(pos), is_padding=torch.cat(pad),
                sample_ids=torch.cat(sid), token_index=torch.cat(tidx))


def _validate(lengths, distributed, local, cp_rank, cp_size, grouped=()):
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside the CP group of size {cp_size}")
    if len(local) != cp_size:
        raise ValueError(f"local has {len(local)} rank lists but cp_size is {cp_size}; "
                         "pass one (possibly empty) list per CP rank")
    for s, first, n in grouped:
        if n < 1 or first < 0 or first + n > cp_size:
            raise ValueError(f"sample {s} is grouped on CP ranks {first}..{first + n - 1}, "
                             f"outside the CP group of size {cp_size}")
    seen = set()
    for s in list(distributed) + [s for rank in local for s in rank] + [g[0] for g in grouped]:
        s = int(s)
        if not 0 <= s < len(lengths):
            raise ValueError(f"sample id {s} out of range [0, {len(lengths)})")
        if s in seen:
            raise ValueError(f"sample id {s} is placed twice in the micro-batch")
        seen.add(s)
        if int(lengths[s]) < 1:
            raise ValueError(f"sample {s} has length {int(lengths[s])}; every sample needs >= 1 token")


def _lookup(per_sample, s):
    try:
        return per_sample[s]
    except (KeyError, IndexError) as exc:
        raise KeyError(f"no tensor for sample {s}; pass every sample this rank holds") from exc


def _empty_like_any(per_sample):
    values = per_sample.values() if isinstance(per_sample, Mapping) else per_sample
    for x in values:
        return x.new_empty((0,) + tuple(x.shape[1:]))
    return torch.empty(0)


def _diffs(cu):
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


T = TypeVar("T")
# layout -> {(name, device): value}: entries go with the layout.
_ON_DEVICE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def on_device(layout: RankLayout, device, name: str, build: Callable[[RankLayout, object], T]) -> T:
    """``build(layout, device)``, computed once per layout, device and ``name``.

    Every layer's forward and backward of a micro-batch share one layout, so what the
    attention derives from it on the device (offsets, index tensors) is built once.
    """
    per_layout = _ON_DEVICE.setdefault(layout, {})
    key = (name, device_key(device))
    if key not in per_layout:
        per_layout[key] = build(layout, device)
    return per_layout[key]


def remember(layout: RankLayout, device, name: str, value) -> None:
    """Caches ``value`` as :func:`on_device`'s ``name`` of ``layout`` on ``device`` (built
    ahead, e.g. staged with the micro-batch's inputs)."""
    _ON_DEVICE.setdefault(layout, {})[(name, device_key(device))] = value

