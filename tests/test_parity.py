"""C++ core (``skrull_ext._C``) vs the Python reference: identical plans, bit for bit.

Random global batches (long-tail Pareto and bimodal lengths, DP 1-8, CP 1-16, tight to
loose buckets, all three roll-back settings, both objectives) go through
``schedule(..., backend=...)`` on both backends; the lower-level functions are compared on random inputs too.  Counters
on the reference prove the batches really exercise roll-back and extra GDS rounds.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.sharding import shard_tokens
from skrull_ext.scheduler import SchedulerConfig, groupfill, reference, schedule

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")

ROLLBACKS = ("shortest", "best-fit", "auto")
CODES = {"shortest": 0, "best-fit": 1, "auto": 2}
VARIANTS = {"paper": 0, "balanced": 1, "lpt": 2, "auto": 3}
OBJECTIVES = {"paper": 0, "ring": 1}
CP_SIZES = (1, 2, 3, 4, 5, 8, 16)


@pytest.fixture(autouse=True)
def _cpp_backend(monkeypatch):
    """Lets backend='cpp' run even when SKRULL_IMPL=python chose the reference."""
    monkeypatch.setattr(_backend, "CPP", _C)


def random_lengths(rng: np.random.Generator, k: int) -> np.ndarray:
    """``[k]`` int64 lengths: long-tail Pareto, bimodal short/long or few distinct values."""
    mode = rng.random()
    if mode < 0.1:  # a few tokens each: zigzag padding dominates the shards
        return rng.integers(1, 5, k).astype(np.int64)
    if mode < 0.25:  # many equal lengths: exercises every length tie-break
        values = rng.integers(1, 4000, int(rng.integers(1, 5)))
        return rng.choice(values, size=k).astype(np.int64)
    if mode < 0.6:
        x = (rng.pareto(rng.uniform(0.8, 2.0), k) + 1.0) * int(rng.integers(20, 400))
        return np.minimum(x, 50_000).astype(np.int64)
    short = rng.integers(1, 600, k)
    long_ = rng.integers(2_000, 20_000, k)
    return np.where(rng.random(k) < 0.8, short, long_).astype(np.int64)


def random_bucket(rng: np.random.Generator, lengths: np.ndarray, cp: int) -> int:
    """A bucket every sample fits: tight (roll-back, many rounds) to loose."""
    need = max(max(shard_tokens(int(s), cp) for s in lengths), 2 * cp if cp > 1 else 1)
    mode = rng.random()
    if mode < 0.4:
        return need + int(rng.integers(0, 8))
    if mode < 0.8:
        return int(need * rng.uniform(1.0, 2.0))
    return int(need * rng.uniform(2.0, 6.0))


def random_batch(rng: np.random.Generator):
    lengths = random_lengths(rng, int(rng.integers(1, 97)))
    cp = int(rng.choice(CP_SIZES))
    return lengths, int(rng.integers(1, 9)), cp, random_bucket(rng, lengths, cp)


def assert_same_plan(lengths, dp, cp, bucket, rollback,
                     dacps=("auto", "balanced", "lpt", "paper"), objective="ring"):
    cost_model = dataclasses.replace(default_cost_model(), objective=objective)
    for dacp in dacps:
        # Refinement off: its parity has its own test (tests/test_refine.py) and the Python
        # reference's search would dominate this test's time.
        cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket, rollback=rollback,
                              dacp=dacp, plan_budget_ms=0)
        py = schedule(lengths, cfg, cost_model, backend="python")
        cpp = schedule(lengths, cfg, cost_model, backend="cpp")
        assert cpp.dp_ranks == py.dp_ranks, (lengths.tolist(), dp, cp, bucket, rollback, dacp,
                                             objective)
    return py  # the paper variant's plan: the counters below look at its roll-backs


class _Counters:
    """Counts roll-back victim choices and infeasible splits inside the reference."""

    def __init__(self, monkeypatch):
        self.victims = 0
        self.failed_splits = 0
        choose, split = reference._choose_victim, reference._split_rank

        def counting_choose(*args, **kwargs):
            self.victims += 1
            return choose(*args, **kwargs)

        def counting_split(*args, **kwargs):
            out = split(*args, **kwargs)
            self.failed_splits += out is None
            return out

        monkeypatch.setattr(reference, "_choose_victim", counting_choose)
        monkeypatch.setattr(reference, "_split_rank", counting_split)


def test_schedule_parity_random_batches(monkeypatch):
    # Two of group-fill's greedy runs (one additive, one overlap estimate) keep these 3,600
    # plans per backend at ~5 min; every run's parity: tests/test_groupfill.py.
    monkeypatch.setattr(groupfill, "RUNS", (groupfill.RUNS[1], groupfill.RUNS[-1]))
    counters = _Counters(monkeypatch)
    rng = np.random.default_rng(20250519)
    n_batches, with_rollback, with_rounds, policies_differ = 1200, 0, 0, 0
    for b in range(n_batches):
        lengths, dp, cp, bucket = random_batch(rng)
        victims, failed = counters.victims, counters.failed_splits
        objective = ("ring", "paper")[b % 2]
        plans = {rb: assert_same_plan(lengths, dp, cp, bucket, rb, objective=objective)
                 for rb in ROLLBACKS}
        with_rollback += counters.victims > victims
        with_rounds += counters.failed_splits > failed
        policies_differ += plans["shortest"].dp_ranks != plans["best-fit"].dp_ranks
    # The batches must really exercise the hard paths, or parity proves little.
    print(f"parity: {n_batches} batches x 3 rollbacks (half ring, half paper objective); roll-back in {with_rollback}, "
          f"extra GDS rounds in {with_rounds}, shortest != best-fit in {policies_differ}")
    assert with_rollback > n_batches // 5, with_rollback
    assert with_rounds > n_batches // 5, with_rounds
    assert policies_differ > n_batches // 50, policies_differ


def test_schedule_parity_larger_batches():
    rng = np.random.default_rng(7)
    for _ in range(6):
        lengths = random_lengths(rng, int(rng.integers(500, 1500)))
        cp = int(rng.choice((2, 4, 8)))
        assert_same_plan(lengths, int(rng.integers(1, 9)), cp, random_bucket(rng, lengths, cp),
                         str(rng.choice(ROLLBACKS)))


@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("case", [
    "one-sample", "equal", "at-limit", "single-tokens", "k-below-dp", "cp1-tight",
    "one-per-micro-batch"])
def test_schedule_parity_edge_cases(case, rollback):
    if case == "one-sample":
        args = (np.array([777]), 4, 8, 26_000)
    elif case == "equal":
        args = (np.full(64, 4096), 3, 4, 4096)
    elif case == "at-limit":  # shard_tokens(S, N) == bucket exactly, with company
        s, n = 8 * 1000 - 5, 8
        assert shard_tokens(s, n) == 1000
        args = (np.array([s, 3, s, 999, 1000, 1]), 2, n, 1000)
    elif case == "single-tokens":
        args = (np.ones(300, dtype=np.int64), 2, 4, 8)
    elif case == "one-per-micro-batch":  # no two fit together: m climbs from K/2 to K
        args = (np.full(150, 104_001), 1, 8, 26_000)
    elif case == "k-below-dp":
        args = (np.array([5000, 17, 300]), 8, 2, 4096)
    else:
        args = (np.array([60, 50, 40, 100, 1, 99]), 2, 1, 100)
    plan = assert_same_plan(*args, rollback)
    if case == "at-limit":
        assert plan.rank_tokens().max() == 1000


def test_dacp_place_and_best_parity():
    rng = np.random.default_rng(11)
    cost_model = default_cost_model()
    seen = {"none": 0, "differ": 0}
    for _ in range(1500):
        lengths = random_lengths(rng, int(rng.integers(1, 60)))
        cp = int(rng.choice(CP_SIZES))
        # From hopeless to roomy: around the total tokens per rank.
        bucket = max(1, int(lengths.sum() / cp * rng.uniform(0.3, 1.5)))
        costs = cost_model.compute_seconds(lengths)
        comm = cost_model.comm_seconds(lengths, cp)
        lat = cost_model.comm_latency(cp)
        idx = rng.permutation(len(lengths))[: int(rng.integers(0, len(lengths) + 1))]
        out = {}
        for rb in ("shortest", "best-fit"):
            want = reference.dacp_place(lengths, costs, idx.tolist(), cp, bucket, rb)
            assert _C.dacp_place(lengths, costs, idx, cp, bucket, CODES[rb]) == want
            out[rb] = want
        for rb in ROLLBACKS:
            for (var, code), (obj, ocode) in itertools.product(VARIANTS.items(),
                                                                OBJECTIVES.items()):
                want = reference.dacp_best(lengths, costs, comm, lat, idx.tolist(), cp, bucket,
                                           rb, var, objective=obj)
                got = _C.dacp_best(lengths, costs, comm, lat, idx, cp, bucket, CODES[rb], code,
                                   objective=ocode)
                assert got == want, (lengths.tolist(), idx.tolist(), cp, bucket, rb, var, obj)
                if want is not None:
                    assert (_C.micro_batch_time(want, costs, comm, lat, cp, objective=ocode)
                            == reference.micro_batch_time(want, costs, comm, lat, cp,
                                                          objective=obj))
        seen["none"] += out["shortest"] is None
        seen["differ"] += out["shortest"] != out["best-fit"]
    print("dacp:", seen)
    assert seen["none"] > 100 and seen["differ"] > 20, seen


def test_lpt_partition_parity_with_ties():
    rng = np.random.default_rng(3)
    for _ in range(300):
        k = int(rng.integers(0, 200))
        # Few distinct values (many ties), zeros and -0.0 included; sometimes large k.
        costs = rng.choice(np.array([0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 1e-9]), size=k)
        if rng.random() < 0.3:
            costs = rng.random(k) * rng.integers(1, 4)
        idx = rng.permutation(k)[: int(rng.integers(0, k + 1))]
        bins = int(rng.integers(1, 24))
        assert _C.lpt_partition(costs, idx, bins) == reference.lpt_partition(
            costs, idx.tolist(), bins)
    big = np.round(rng.random(20_000) * 50) / 7  # radix-sort path, with ties
    ids = np.arange(20_000)
    for bins in (1, 4, 17, 64):
        assert _C.lpt_partition(big, ids, bins) == reference.lpt_partition(big, ids, bins)


def test_interleave_and_shard_tokens_parity():
    rng = np.random.default_rng(5)
    for _ in range(200):
        seq = rng.integers(0, 1000, int(rng.integers(0, 50)))
        m = int(rng.integers(1, 60))
        assert _C.interleave(seq, m) == reference.interleave(seq.tolist(), m)
    for s in range(1, 300):
        for n in (1, 2, 3, 4, 7, 8, 16):
            assert _C.shard_tokens(s, n) == shard_tokens(s, n)


def test_core_gds_parity_with_overhead():
    """The raw core calls agree too (different overheads change the re-split choice)."""
    rng = np.random.default_rng(9)
    cost_model = default_cost_model()
    for _ in range(150):
        lengths, dp, cp, bucket = random_batch(rng)
        costs = cost_model.compute_seconds(lengths)
        comm = cost_model.comm_seconds(lengths, cp)
        lat = cost_model.comm_latency(cp)
        overhead = float(rng.choice([0.0, 1e-4, 2e-3, 1.0]))
        rb = str(rng.choice(ROLLBACKS))
        var = str(rng.choice(list(VARIANTS)))
        obj = str(rng.choice(list(OBJECTIVES)))
        want = reference.gds_schedule(lengths, costs, comm, lat, dp, cp, bucket, rb, overhead,
                                      var, objective=obj)
        got = _C.gds_schedule(lengths, costs, comm, lat, dp, cp, bucket, CODES[rb], overhead,
                              VARIANTS[var], objective=OBJECTIVES[obj])
        assert got == want


@pytest.mark.parametrize("lengths, costs, cp, bucket, rollback", [
    # Roll-back whose demotion leaves the fullest rank at exactly 0 tokens.
    ([7, 28, 1, 16, 10, 27], None, 4, 29, 0),
    # best-fit victim after which the pending sample fits a rank exactly.
    ([7, 17, 16, 17, 1], [4.0, 4.0, 3.0, 2.0, 3.0], 2, 30, 1),
])
def test_dacp_rollback_boundaries(lengths, costs, cp, bucket, rollback):
    lengths = np.array(lengths)
    costs = lengths.astype(np.float64) if costs is None else np.array(costs)
    idx = list(range(len(lengths)))
    want = reference.dacp_place(lengths, costs, idx, cp, bucket, ROLLBACKS[rollback])
    assert want is not None
    assert _C.dacp_place(lengths, costs, np.array(idx), cp, bucket, rollback) == want


@pytest.mark.parametrize("overhead", [0.0, 350.0, 500.0])
def test_gds_resplit_with_empty_micro_batches(overhead):
    """Empty micro-batches of a re-split cost no overhead (the 350 s case hinges on it)."""
    lengths = np.array([60, 60, 60, 200, 200, 200, 200])
    costs = np.array([100.0, 1, 1, 26, 26, 26, 26])
    comm = np.full(7, 1000.0)
    want = reference.gds_schedule(lengths, costs, comm, 0.0, 2, 2, 100, "auto", overhead)
    assert _C.gds_schedule(lengths, costs, comm, 0.0, 2, 2, 100, 2, overhead) == want


def test_parity_with_explicit_shares():
    """Per-rank shares that are not ``costs / N`` (kernel efficiency, call overheads)."""
    rng = np.random.default_rng(21)
    base = default_cost_model()
    eff = dataclasses.replace(base, time=dataclasses.replace(
        base.time, attention_half_tokens=512.0, attention_call_overhead=2e-4))
    for _ in range(120):
        lengths, dp, cp, bucket = random_batch(rng)
        costs = eff.compute_seconds(lengths)
        shares = eff.share_seconds(lengths, cp)
        comm = eff.comm_seconds(lengths, cp)
        lat = eff.comm_latency(cp)
        rb = str(rng.choice(ROLLBACKS))
        var = str(rng.choice(list(VARIANTS)))
        want = reference.gds_schedule(lengths, costs, comm, lat, dp, cp, bucket, rb, 1e-3, var,
                                      shares)
        got = _C.gds_schedule(lengths, costs, comm, lat, dp, cp, bucket, CODES[rb], 1e-3,
                              VARIANTS[var], shares)
        assert got == want
        # A small refinement budget: the Python reference's search would dominate the time.
        cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket, rollback=rb, dacp=var,
                              plan_budget_ms=0.2)
        assert (schedule(lengths, cfg, eff, backend="cpp").dp_ranks
                == schedule(lengths, cfg, eff, backend="python").dp_ranks)


def test_can_pair_parity_and_isolating_batches():
    """``can_pair`` agrees; batches with samples that must be isolated schedule alike."""
    rng = np.random.default_rng(5)
    for _ in range(3000):
        n = int(rng.choice(CP_SIZES))
        c = int(rng.integers(2, 200))
        sx, sy = (int(x) for x in rng.integers(1, 2 * n * c + 1, size=2))
        assert _C.can_pair(sx, sy, n, c) == reference.can_pair(sx, sy, n, c)
    isolated = 0
    for _ in range(200):
        cp = int(rng.choice([2, 4, 8]))
        bucket = int(rng.integers(64, 512))
        big = 2 * cp * (bucket // 2) - int(rng.integers(0, 2 * cp))  # shard == bucket
        lengths = np.concatenate([rng.integers(1, bucket, size=int(rng.integers(2, 30))),
                                  np.full(int(rng.integers(1, 4)), big)])
        rng.shuffle(lengths)
        isolated += not reference.can_pair(big, int(lengths.min()), cp, bucket)
        assert_same_plan(lengths, int(rng.integers(1, 4)), cp, bucket, "auto")
    assert isolated > 100, isolated


def test_baseline_groupings_and_portfolio_parity():
    """Every baseline grouping (Karmarkar-Karp, sorted, dataset-order, per-sample, hybrid
    CP) and the portfolio over them agree between the backends, both objectives."""
    from skrull_ext.scheduler import portfolio
    from skrull_ext.scheduler.baselines import GROUPINGS

    rng = np.random.default_rng(11)
    chose = set()
    for trial in range(120):
        lengths, dp, cp, bucket = random_batch(rng)
        obj = ("paper", "ring")[trial % 2]
        cm = dataclasses.replace(default_cost_model(), objective=obj)
        costs, comm = cm.compute_seconds(lengths), cm.comm_seconds(lengths, cp)
        shares, lat = cm.share_seconds(lengths, cp), cm.comm_latency(cp)
        for name, fn in GROUPINGS.items():
            want = [[[int(i) for i in g] for g in r] for r in fn(lengths, costs, dp, cp, bucket)]
            assert _C.baseline_groups(lengths, costs, dp, cp, bucket, name) == want, name
        want = portfolio.portfolio_schedule(lengths, costs, comm, lat, dp, cp, bucket, "auto",
                                            2e-3, "auto", shares, obj)
        gds = reference.gds_schedule(lengths, costs, comm, lat, dp, cp, bucket, "auto", 2e-3,
                                     "auto", shares, obj)
        chose.add(want != gds)
        assert _C.portfolio_schedule(lengths, costs, comm, lat, dp, cp, bucket, 2, 2e-3, 3,
                                     shares, objective=OBJECTIVES[obj]) == want
    assert chose == {True, False}  # the batches exercise both outcomes


def test_portfolio_parity_when_gds_splits_far_too_finely():
    """A tight bucket: GDS alone needs several times the micro-batches of the sorted
    grouping, so C++ stops GDS early (its cutoff); the plan is still the reference's."""
    from skrull_ext.scheduler import portfolio

    rng = np.random.default_rng(2)
    lengths = np.minimum(np.ceil(200.0 * (1.0 + rng.pareto(1.1, 300))), 4 * 800 - 8)
    lengths = lengths.astype(np.int64)
    cm = default_cost_model()
    args = (lengths, cm.compute_seconds(lengths), cm.comm_seconds(lengths, 4),
            cm.comm_latency(4), 2, 4, 800)
    shares = cm.share_seconds(lengths, 4)
    gds = reference.gds_schedule(*args, "auto", 2e-3, "auto", shares, "ring")
    want = portfolio.portfolio_schedule(*args, "auto", 2e-3, "auto", shares, "ring")
    assert len(gds[0]) > 2 * len(want[0])
    assert _C.portfolio_schedule(*args, 2, 2e-3, 3, shares, objective=1) == want
