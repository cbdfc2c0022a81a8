"""Shared check of the C++ sub-group candidates (hybrid CP, dynamic CP) against their spec."""
from __future__ import annotations

import numpy as np

from skrull_ext.scheduler.plan import flatten_placements


def assert_same_plan(plan, predicted, ref, ref_predicted, cfg):
    """The core's plan is the Python spec's bit for bit: placements, price, flat arrays.

    Args:
        plan, predicted: the C++ build's plan and its ``predict()`` dict.
        ref, ref_predicted: the Python build's.
        cfg: the batch's ``SchedulerConfig`` (for the error message and CP size).

    Returns:
        The plan's flat arrays (``FlatPlan``), for further checks.
    """
    assert plan.dp_ranks == ref.dp_ranks, cfg
    assert predicted == ref_predicted  # float64, exactly: the same float operations
    flat, want = plan.flat, flatten_placements(ref.dp_ranks, cfg.cp_size)
    assert flat.verified and flat.count == want.count and flat.grouped == want.grouped
    for name in ("dist_ids", "dist_mb", "local_ids", "local_slot"):
        np.testing.assert_array_equal(getattr(flat, name), getattr(want, name))
    return flat
