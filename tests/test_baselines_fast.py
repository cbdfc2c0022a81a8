"""The kk and hybrid-CP baseline policies group with the C++ core when it is built (the
Python groupings take seconds at GBS 4096): their plans must equal the pure-Python ones."""
from __future__ import annotations

import numpy as np
import pytest

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler.baselines import BASELINES
from test_parity import random_batch

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")


@pytest.mark.parametrize("name", ["kk", "hybrid-cp"])
def test_cpp_grouped_baselines_equal_python(monkeypatch, name):
    rng = np.random.default_rng(3)
    cm = default_cost_model()
    for _ in range(60):
        lengths, dp, cp, bucket = random_batch(rng)
        costs = cm.compute_seconds(lengths)
        monkeypatch.setattr(_backend, "CPP", _C)
        fast = BASELINES[name](lengths, costs, dp, cp, bucket)
        monkeypatch.setattr(_backend, "CPP", None)
        slow = BASELINES[name](lengths, costs, dp, cp, bucket)
        assert fast == slow, (lengths.tolist(), dp, cp, bucket)


@pytest.mark.parametrize("k,cp,bucket", [(3000, 8, 600), (2000, 6, 500), (1500, 16, 200)])
def test_cpp_hybrid_first_fit_index_equals_the_linear_scan(k, cp, bucket):
    """Hundreds of micro-batches per DP rank (several of the core's 32-micro-batch runs),
    a CP size that is not a power of two: the indexed first fit picks the reference's
    micro-batch and block for every sample."""
    from skrull_ext.scheduler.baselines import _cpp_hybrid_items, _hybrid_micro_batches

    rng = np.random.default_rng(k)
    lengths = np.minimum(np.ceil(60 * (1 + rng.pareto(1.1, k))), cp * bucket - 2 * cp)
    lengths = lengths.astype(np.int64)
    costs = lengths.astype(np.float64) ** 1.5
    ref = _hybrid_micro_batches(lengths, costs, 2, cp, bucket, fast=False)
    assert min(len(mbs) for mbs in ref) > 64
    got = _cpp_hybrid_items(lengths, costs, 2, cp, bucket)
    assert [[[tuple(x) for x in mb] for mb in mbs] for mbs in got] == \
        [[mb["items"] for mb in mbs] for mbs in ref]
