"""Rank layout: zigzag sharding, positions, padding, packing round trips (single process)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skrull_ext.attention.layout import build_rank_layout, layout_for_micro_batch, pack_samples
from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.sharding import padded_length


@st.composite
def micro_batches(draw):
    cp_size = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=9))
    # Hybrid-CP sub-groups: every aligned power-of-two block of ranks (sizes 2 .. N/2).
    subs = [(f, n) for n in (2, 4) if n < cp_size for f in range(0, cp_size - n + 1, n)]
    owner = draw(st.lists(st.integers(-1 - len(subs), cp_size - 1), min_size=len(lengths),
                          max_size=len(lengths)))
    distributed = [i for i, o in enumerate(owner) if o == -1]
    local = [[i for i, o in enumerate(owner) if o == r] for r in range(cp_size)]
    grouped = [(i, *subs[-2 - o]) for i, o in enumerate(owner) if o < -1]
    return lengths, distributed, local, cp_size, grouped


def layouts(lengths, distributed, local, cp_size, grouped=()):
    return [build_rank_layout(lengths, distributed, local, r, cp_size, grouped)
            for r in range(cp_size)]


@settings(max_examples=60, deadline=None)
@given(micro_batches())
def test_every_token_exactly_once_and_positions(mb):
    lengths, distributed, local, n, grouped = mb
    seen = {s: torch.zeros(ln, dtype=torch.long) for s, ln in enumerate(lengths)}
    lays = layouts(lengths, distributed, local, n, grouped)
    for lay in lays:
        real = ~lay.is_padding
        for s, t in zip(lay.sample_ids[real].tolist(), lay.token_index[real].tolist()):
            seen[s][t] += 1
        # Real tokens sit at their own position; everything is within the padded sequence.
        assert torch.equal(lay.position_ids[real], lay.token_index[real])
        assert (lay.sample_ids[lay.is_padding] == -1).all()
        assert (lay.token_index[lay.is_padding] == -1).all()
        assert lay.num_tokens == lay.position_ids.numel() == lay.is_padding.numel()
        # Token count agrees with the plan's accounting.
        assert lay.num_tokens == MicroBatch(
            distributed=tuple(distributed), local=tuple(map(tuple, local)),
            grouped=tuple(grouped)).rank_tokens(lengths)[lay.cp_rank]
    for s in distributed + [i for r in local for i in r] + [g[0] for g in grouped]:
        assert (seen[s] == 1).all(), f"sample {s} coverage {seen[s].tolist()}"
    # The distributed part has the same shape on every rank (fixed-size ring messages),
    # and so has each sub-group's part on the ranks of that sub-group.
    assert len({lay.dist_cu_seqlens for lay in lays}) == 1
    parts = {}
    for lay in lays:
        assert [(g.first_rank, g.size) for g in lay.groups] == sorted(
            {(f, k) for _, f, k in grouped if f <= lay.cp_rank < f + k})
        for g in lay.groups:
            parts.setdefault((g.first_rank, g.size), set()).add(g.cu_seqlens)
            assert g.offset == lay.num_local_tokens + lay.num_distributed_tokens + sum(
                h.num_tokens for h in lay.groups[:lay.groups.index(g)])
    assert all(len(v) == 1 for v in parts.values())
    pads = sum(int(lay.is_padding.sum()) for lay in lays)
    assert pads == (sum(padded_length(lengths[s], n) - lengths[s] for s in distributed)
                    + sum(padded_length(lengths[s], k) - lengths[s] for s, _, k in grouped))


def test_zigzag_chunks_and_stream_order():
    lengths = [5, 17, 3, 9]
    lay = build_rank_layout(lengths, [1, 2], [[3, 0], []], 0, 2)
    # local docs first, in list order
    assert lay.local_samples == (3, 0) and lay.local_cu_seqlens == (0, 9, 14)
    assert lay.sample_ids[:14].tolist() == [3] * 9 + [0] * 5
    # sample 1: 17 -> padded 20, chunk 5; rank 0 holds chunks 0 and 3
    d1, d2 = lay.distributed
    assert (d1.sample, d1.padded_length, d1.chunk_size, d1.offset, d1.shard_length) == (1, 20, 5, 14, 10)
    assert lay.position_ids[14:24].tolist() == [0, 1, 2, 3, 4, 15, 16, 17, 18, 19]
    assert lay.is_padding[14:24].tolist() == [False] * 7 + [True] * 3
    # sample 2: 3 -> padded 4, chunk 1: chunks 0 and 3; position 3 is padding
    assert lay.position_ids[24:].tolist() == [0, 3] and lay.is_padding[24:].tolist() == [False, True]
    r1 = build_rank_layout(lengths, [1, 2], [[3, 0], []], 1, 2)
    assert r1.local_cu_seqlens == (0,) and r1.num_local_tokens == 0
    assert r1.position_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 1, 2]
    assert not r1.is_padding.any()


def test_cp_size_one_holds_distributed_whole():
    lay = build_rank_layout([7, 4], [0], [[1]], 0, 1)
    assert lay.num_tokens == 11 and not lay.is_padding.any()
    d = lay.distributed[0]
    assert (d.padded_length, d.chunk_size, d.shard_length) == (7, 0, 7)
    assert lay.position_ids.tolist() == [0, 1, 2, 3] + list(range(7))


def test_pack_unpack_round_trip_and_grad():
    lengths, distributed, local = [6, 11, 1, 4, 9], [1, 2, 4], [[0], [], [3]]
    n = 3
    xs = [torch.randn(ln, 2, dtype=torch.float64, requires_grad=True) for ln in lengths]
    total = {s: torch.zeros(ln, 2, dtype=torch.float64) for s, ln in enumerate(lengths)}
    for lay in layouts(lengths, distributed, local, n):
        packed = lay.pack(xs, fill=7.0)
        assert packed.shape == (lay.num_tokens, 2)
        assert (packed[lay.is_padding] == 7.0).all()
        back = lay.unpack(packed)
        assert set(back) == set(lay.samples)
        for s, t in back.items():
            total[s] = total[s] + t.detach()
        back[1].sum().backward()  # gradient flows only to the rows this rank holds
        held = torch.zeros(lengths[1], dtype=torch.bool)
        held[lay.token_index[lay.sample_ids == 1]] = True
        assert torch.equal(xs[1].grad[:, 0] != 0, held)
        xs[1].grad = None
    for s, x in enumerate(xs):
        torch.testing.assert_close(total[s], x.detach())


def test_pack_samples_for_data_pipeline():
    lengths = [5, 3]
    tokens = [torch.arange(10, 15), torch.arange(20, 23)]
    labels = [t + 1 for t in tokens]
    mask = [torch.tensor([0, 1, 1, 1, 0]), torch.ones(3)]
    lay = build_rank_layout(lengths, [0, 1], [[], []], 1, 2)
    p = pack_samples(lay, {0: tokens[0], 1: tokens[1]}, labels, mask, pad_token_id=-5, pad_label=-7)
    # sample 0: padded 8, chunk 2; rank 1 holds chunks 1, 2 -> positions 2..5 (5 is padding)
    # sample 1: padded 4, chunk 1; rank 1 holds chunks 1, 2 -> positions 1, 2
    assert p.tokens.tolist() == [12, 13, 14, -5, 21, 22]
    assert p.labels.tolist() == [13, 14, 15, -7, 22, 23]
    assert p.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert p.loss_mask.dtype == torch.float32
    assert p.position_ids.tolist() == [2, 3, 4, 5, 1, 2]
    assert p.is_padding.tolist() == [False, False, False, True, False, False]
    default = pack_samples(lay, tokens)
    assert default.labels is None
    assert torch.equal(default.loss_mask, (~lay.is_padding).float())


def test_layout_for_micro_batch_matches():
    mb = MicroBatch(distributed=(2,), local=((0,), (1, 3)))
    lengths = [4, 2, 9, 5]
    a = layout_for_micro_batch(mb, lengths, 1)
    b = build_rank_layout(lengths, [2], [[0], [1, 3]], 1, 2)
    assert torch.equal(a.position_ids, b.position_ids) and a.segments == b.segments



def test_grouped_shards_follow_the_distributed_part():
    """A grouped sample is zigzag-sharded over its sub-group only, after the full ring's
    part; a rank outside every sub-group holds none of it."""
    lengths = [4, 13, 9, 6]
    mb = MicroBatch(distributed=(2,), local=((0,), (), (), ()), grouped=((1, 2, 2), (3, 2, 2)))
    r3 = layout_for_micro_batch(mb, lengths, 3)
    # sample 2 over 4 ranks: padded 16, chunks of 2 (rank 3: chunks 3, 4); then the
    # sub-group {2, 3}: sample 1 padded 16, chunks of 4 (rank 1 of 2: chunks 1, 2), and
    # sample 3 padded 8, chunks of 2 (chunks 1, 2).
    assert r3.samples == (2, 1, 3) and r3.num_tokens == 4 + 8 + 4 == mb.rank_tokens(lengths)[3]
    (part,) = r3.groups
    assert (part.first_rank, part.size, part.offset, part.cu_seqlens) == (2, 2, 4, (0, 8, 12))
    assert r3.position_ids[4:].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5]
    assert r3.is_padding[4:].tolist() == [False] * 8 + [False, False, False, False]
    r0 = layout_for_micro_batch(mb, lengths, 0)
    assert r0.groups == () and r0.samples == (0, 2)
    r2 = layout_for_micro_batch(mb, lengths, 2)
    assert r2.position_ids[4:].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 0, 1, 6, 7]
    assert r2.is_padding[4:].tolist() == [False] * 5 + [True] * 3 + [False, False, True, True]
    with pytest.raises(ValueError, match="outside the CP group"):
        build_rank_layout(lengths, [], [[], []], 0, 2, grouped=[(1, 1, 2)])


def test_empty_rank():
    lay = build_rank_layout([3], [], [[0], []], 1, 2)
    assert lay.num_tokens == 0 and lay.samples == ()
    assert lay.pack([torch.ones(3, 4)]).shape == (0, 4)
    assert lay.unpack(torch.zeros(0, 4)) == {}


@pytest.mark.parametrize("args, match", [
    (([3, 4], [0], [[0], []], 0, 2), "placed twice"),
    (([3, 4], [5], [[], []], 0, 2), "out of range"),
    (([3, 0], [1], [[], []], 0, 2), "length 0"),
    (([3, 4], [0], [[1]], 0, 2), "cp_size is 2"),
    (([3, 4], [0], [[1], []], 2, 2), "outside the CP group"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        build_rank_layout(*args)


def test_pack_checks_lengths():
    lay = build_rank_layout([3, 4], [0], [[1], []], 0, 2)
    with pytest.raises(ValueError, match="same lengths"):
        lay.pack([torch.zeros(3), torch.zeros(5)])
    with pytest.raises(KeyError, match="sample 1"):
        lay.pack({0: torch.zeros(3)})


def test_zigzag_blocks_index_the_chunks_and_are_built_once_per_layout():
    from skrull_ext.attention.ring import zigzag_blocks

    lay = build_rank_layout([5, 17, 3, 9], [1, 2], [[3, 0], []], 0, 2)
    zz = zigzag_blocks(lay, torch.device("cpu"))
    # Relative to the distributed part: sample 1 holds [0, 10) (chunks of 5), sample 2 [10, 12).
    assert zz.cu_full == (0, 10, 12) and zz.cu_half == (0, 5, 6)
    assert zz.first.tolist() == [0, 1, 2, 3, 4, 10] and zz.second.tolist() == [5, 6, 7, 8, 9, 11]
    assert zigzag_blocks(lay, torch.device("cpu")) is zz  # every layer reuses it
    other = build_rank_layout([5, 17, 3, 9], [1, 2], [[3, 0], []], 0, 2)
    assert zigzag_blocks(other, torch.device("cpu")) is not zz
