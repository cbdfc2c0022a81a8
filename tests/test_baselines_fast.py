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
