"""The online cost-model refit (skrull_ext/costmodel/online.py): robust, unbiased, identical.

Synthetic measurements with known coefficients; no timing.  Identity across ranks: every
rank feeds the refit the same plans and the same all-reduced time
(``tests/test_plan_ahead.py`` checks the all-reduce), so the refit itself must be a pure,
deterministic function of its inputs, insensitive to last-bit differences of a BLAS.
"""
from __future__ import annotations

import numpy as np
import pytest

from skrull_ext.costmodel.model import CostModel, ModelSpec, TimeModel
from skrull_ext.costmodel.online import (FEATURES, TERMS, OnlineRefit, RefitConfig, additive,
                                         robust_fit, scaled)
from skrull_ext.scheduler import SchedulerConfig, predict, schedule

K = len(TERMS)
RNG = np.random.default_rng(7)
SPEC = ModelSpec(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256)
SEED = CostModel(model=SPEC, time=TimeModel(c_linear=1e-11, c_attention=1e-11,
                                            micro_batch_overhead=2e-3,
                                            attention_call_overhead=5e-5,
                                            iteration_overhead=0.01))


def _additive(n: int, seed: int = 0) -> np.ndarray:
    """``[n, len(FEATURES)]`` term seconds of differing mixes; ``full`` their sum."""
    rng = np.random.default_rng(seed)
    terms = rng.uniform(0.01, 1.0, size=(n, K)) * np.array([1.0, 0.5, 0.1, 0.05, 0.02, 0.2])
    return np.hstack([terms, terms.sum(1, keepdims=True)])


def test_recovers_known_coefficients_despite_outliers():
    x = _additive(16)
    w_true, b_true = np.array([2.0, 3.0, 0.7, 1.5, 0.5, 4.0]), 0.05
    y = x[:, :K] @ w_true + b_true
    y[[3, 11]] *= 6.0  # a checkpoint save, a busy neighbour
    w, b, _ = robust_fit(x, y, seed_overhead=0.01, config=RefitConfig(ridge=0.0, terms_after=2))
    np.testing.assert_allclose(w, w_true, rtol=0.02)
    assert b == pytest.approx(b_true, rel=0.05)


def test_a_seed_far_off_is_rescaled_without_bias():
    """1000x too fast (an H100 preset on CPU): few, collinear iterations still give 1000x."""
    x = _additive(3, seed=1)
    x[:, :K] = x[:1, :K] * np.array([[1.0], [1.2], [0.9]])  # same mix: terms not separable
    x[:, K] = x[:, :K].sum(1)
    y = 1000.0 * x[:, K] + 0.3
    w, b, s = robust_fit(x, y, seed_overhead=1e-4)
    pred = x[:, :K] @ w + b
    np.testing.assert_allclose(pred, y, rtol=0.01)
    np.testing.assert_allclose(w, 1000.0, rtol=0.05)
    assert s == pytest.approx(1000.0, rel=0.05)


def test_recent_iterations_weigh_more():
    """The machine got 2x slower halfway: the fit follows the recent half."""
    x = _additive(16, seed=2)
    y = x[:, K] * np.where(np.arange(16) < 8, 1.0, 2.0)
    w, b, s = robust_fit(x, y, seed_overhead=0.0, config=RefitConfig(half_life=2.0))
    np.testing.assert_allclose((x[-4:, :K] @ w + b) / y[-4:], 1.0, atol=0.1)


def test_refit_is_deterministic_and_blind_to_last_bits():
    x = _additive(10, seed=3)
    y = x[:, :K] @ np.array([1.3, 0.7, 0.9, 2.0, 1.0, 0.4]) + 0.02
    one = robust_fit(x, y, seed_overhead=0.01)
    two = robust_fit(x.copy(), y.copy(), seed_overhead=0.01)
    assert one[0].tobytes() == two[0].tobytes() and one[1:] == two[1:]
    nudged = robust_fit(x * (1 + 1e-15), y * (1 - 1e-15), seed_overhead=0.01)
    assert one[0].tobytes() == nudged[0].tobytes() and one[1:] == nudged[1:]


def _features(plan):
    from skrull_ext.costmodel.online import term_models

    models = term_models(SEED)
    return [predict(plan, models[name])["iteration_time"] for name in FEATURES]


def test_online_refit_on_real_plans_predicts_a_slower_machine():
    """Real plans of the reference scheduler, a machine 3x slower with 40 ms fixed cost."""
    config = SchedulerConfig(dp_size=1, cp_size=2, bucket_size=4096, policy="skrull")
    refits = [OnlineRefit(SEED), OnlineRefit(SEED)]  # two "ranks"
    assert refits[0].observe(_features(schedule(np.array([64, 128]), config, SEED)), 0.5) \
        is None  # warm-up iteration skipped
    refits[1].observe(_features(schedule(np.array([64, 128]), config, SEED)), 0.5)
    for i in range(6):
        lengths = RNG.integers(16, 3000, size=8)
        plan = schedule(lengths, config, SEED)
        truth = 3.0 * (predict(plan, SEED)["iteration_time"] - 0.01) + 0.04
        truth *= 1.3 if i == 2 else 1.0  # one noisy iteration
        models = [r.observe(_features(plan), truth) for r in refits]
    assert models[0] == models[1]
    for _ in range(3):  # fresh batches
        plan = schedule(RNG.integers(16, 3000, size=8), config, SEED)
        truth = 3.0 * (predict(plan, SEED)["iteration_time"] - 0.01) + 0.04
        assert predict(plan, models[0])["iteration_time"] == pytest.approx(truth, rel=0.05)


def test_bad_measurements_are_ignored():
    refit = OnlineRefit(SEED, RefitConfig(skip_first=0, min_samples=1))
    feats = np.full(len(FEATURES), 0.1)
    assert refit.observe(feats, float("nan")) is None
    assert refit.observe(feats, 0.0) is None
    assert refit.observe(feats, 1.0) is not None


def test_few_iterations_rescale_the_seed_and_keep_its_plans():
    """Before ``terms_after`` iterations every term gets the common scale: same decisions."""
    # Placement only (budget 0): the local search's tie-breaks between equal-time moves
    # may differ in the last bits of a rescaled model; its predictions are checked below.
    config = SchedulerConfig(dp_size=2, cp_size=2, bucket_size=2048, policy="skrull",
                             plan_budget_ms=0.0)
    refined = SchedulerConfig(dp_size=2, cp_size=2, bucket_size=2048, policy="skrull")
    refit = OnlineRefit(SEED, RefitConfig(skip_first=0, terms_after=8))
    for _ in range(4):
        plan = schedule(RNG.integers(16, 3000, size=16), config, SEED)
        model = refit.observe(_features(plan), 7.0 * predict(plan, SEED)["iteration_time"])
    np.testing.assert_allclose(refit.multipliers, refit.scale)
    assert refit.scale > 5.0
    def placed(plan):  # which samples go where (equal-time ties may order them otherwise)
        return [[(frozenset(mb.distributed), tuple(map(frozenset, mb.local))) for mb in mbs]
                for mbs in plan.dp_ranks]

    for _ in range(3):
        lengths = RNG.integers(16, 3000, size=16)
        assert placed(schedule(lengths, config, model)) == placed(schedule(lengths, config,
                                                                            SEED))
        ours, seeds = (predict(schedule(lengths, refined, m), SEED)["iteration_time"]
                       for m in (model, SEED))
        # Refined: the local search and ruin and recreate compare the rescaled model's
        # times, whose last bits differ, so they may stop on another plan of near-equal time.
        assert ours == pytest.approx(seeds, rel=1e-3)


SHORT_SEED = CostModel(model=SPEC, time=TimeModel(c_linear=1e-11, c_attention=1e-11,
                                                  attention_half_tokens=600.0,
                                                  micro_batch_overhead=2e-3,
                                                  attention_call_overhead=5e-5,
                                                  iteration_overhead=0.01))


def _plans(n: int, seed: int, cost=SEED):
    """Plans of mixed batches (a few long samples, many short), DP 1 x CP 2."""
    rng = np.random.default_rng(seed)
    config = SchedulerConfig(dp_size=1, cp_size=2, bucket_size=8192, policy="skrull")
    return [schedule(np.append(rng.integers(16, 600, size=12), rng.integers(16, 9000, size=2)),
                     config, cost) for _ in range(n)]


def test_terms_add_up_to_the_seeds_prediction():
    """Additive terms (ring overlap included), so w = s is exactly a rescaled seed."""
    from skrull_ext.costmodel.online import term_models

    models = term_models(SHORT_SEED)
    rows = [additive([predict(p, models[n])["iteration_time"] for n in FEATURES])
            for p in _plans(6, seed=11, cost=SHORT_SEED)]
    for row in rows:
        assert (row >= 0).all() and row[TERMS.index("attention_short")] > 0
        assert row[:K].sum() == pytest.approx(row[K], rel=1e-12)
    x = np.stack(rows)
    y = 2.5 * x[:, K] + 0.03
    w, b, s = robust_fit(x, y, seed_overhead=0.01, config=RefitConfig(terms_after=2))
    # Stage 1's intercept is pulled weakly to the seed's (0.025): the small terms absorb
    # that; the large ones and the predictions stay put.
    assert s == pytest.approx(2.5, rel=1e-3)
    np.testing.assert_allclose(w[:3], 2.5, rtol=0.01)
    np.testing.assert_allclose(x[:, :K] @ w + b, y, rtol=1e-3)


def test_scaled_splits_the_short_block_surcharge_exactly():
    """``scaled`` maps the multipliers onto c_attention and attention_half_tokens; equal
    multipliers are a plain rescaling of the seed."""
    w = np.array([1.5, 3.0, 0.5, 2.0, 1.0, 4.0])
    model = scaled(SHORT_SEED, w, 0.02)
    assert model.time.c_attention == pytest.approx(3.0 * SHORT_SEED.time.c_attention)
    assert model.time.attention_half_tokens == pytest.approx(600.0 * 0.5 / 3.0)
    assert model.time.c_linear == pytest.approx(1.5 * SHORT_SEED.time.c_linear)
    same = scaled(SHORT_SEED, np.full(K, 2.5), 0.02)
    for plan in _plans(3, seed=12, cost=SHORT_SEED):
        assert predict(plan, same)["iteration_time"] == pytest.approx(
            2.5 * (predict(plan, SHORT_SEED)["iteration_time"] - 0.01) + 0.02, rel=1e-9)
