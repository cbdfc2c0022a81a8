"""One copy per micro-batch: skrull_ext.attention.staging and meta.stage_layout.

The staged metadata must be exactly what the lazily built one is (every tensor, every host
int), live in one device buffer, and be what every layer then finds in the layout's cache.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from skrull_ext.attention.kernels import Segments, segments
from skrull_ext.attention.layout import layout_for_micro_batch, on_device
from skrull_ext.attention.meta import build_meta, layout_meta, stage_layout
from skrull_ext.attention.staging import ALIGN, stage, to_device
from skrull_ext.scheduler.plan import MicroBatch

CPU = torch.device("cpu")


def test_to_device_packs_any_dtype_and_shape_into_one_buffer():
    host = [torch.arange(5), torch.tensor([True, False, True]), torch.rand(2, 3),
            torch.empty(0, dtype=torch.int32), torch.tensor(3.5, dtype=torch.float64),
            torch.tensor([1, 2], dtype=torch.int32)[1:], torch.rand(4, 3).t()]  # views too
    out = to_device(host, CPU)
    storage = {t.untyped_storage().data_ptr() for t in out}
    assert len(storage) == 1  # one buffer, one copy
    for a, b in zip(host, out):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous()
        assert torch.equal(a, b)
        assert (b.storage_offset() * b.element_size()) % ALIGN == 0
    host[0][0] = 99  # a copy, not an alias of the host tensors
    assert out[0][0] == 0


def _same(a, b, path="meta"):
    """Field-by-field equality of (nested) metadata; tensors by value and dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("rank", [0, 2, 3])
def test_staged_metadata_equals_the_lazy_one_and_is_what_layers_find(rank):
    # CP 4: a distributed sample (full ring), grouped samples on the sub-group {2, 3}
    # (hybrid CP), a local one on rank 0 -- every kind of metadata the attention builds.
    lengths = [4, 13, 9, 6]
    mb = MicroBatch(distributed=(2,), local=((0,), (), (), ()), grouped=((1, 2, 2), (3, 2, 2)))
    lazy = build_meta(layout_for_micro_batch(mb, lengths, rank), CPU)
    layout = layout_for_micro_batch(mb, lengths, rank)
    tokens = torch.arange(layout.num_tokens) + 7
    (moved,) = stage_layout(layout, CPU, (tokens,))
    assert torch.equal(moved, tokens)
    staged = layout_meta(layout, CPU)  # what every layer's attention call gets
    _same(lazy, staged)
    positions = on_device(layout, CPU, "position_ids", lambda *_: pytest.fail("not staged"))
    assert torch.equal(positions, layout.position_ids)
    # everything came over in the one copy
    assert positions.untyped_storage().data_ptr() == moved.untyped_storage().data_ptr()
    assert staged.causal.cu_dev.untyped_storage().data_ptr() == moved.untyped_storage().data_ptr()


def test_cp1_layout_is_one_causal_call():
    layout = layout_for_micro_batch(MicroBatch(distributed=(1,), local=((0, 2),)), [3, 5, 4], 0)
    stage_layout(layout, CPU)
    meta = layout_meta(layout, CPU)
    assert not meta.use_ring and meta.groups == () and meta.num_causal == layout.num_tokens
    assert meta.causal.cu == (0, 3, 7, 12) and meta.causal.cu_dev.tolist() == [0, 3, 7, 12]


def test_stage_needs_the_same_moves_twice():
    calls = []

    def build(move):
        calls.append(1)
        return [move(torch.ones(2)) for _ in range(3 - len(calls))]  # 2 moves, then 1

    with pytest.raises(RuntimeError, match="fewer tensors"):
        stage(build, CPU)


def test_segments_are_checked_once_when_built():
    seg = segments((0, 2, 2, 5), CPU)
    assert isinstance(seg, Segments) and seg.max_len == 3 and seg.has_empty
    assert not segments((0, 1, 4), CPU).has_empty
    for bad in ((1, 3), (0, 4, 2), ()):
        with pytest.raises(ValueError, match="start at 0 and not decrease"):
            segments(bad, CPU)
