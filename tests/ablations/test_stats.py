"""Acceptance tests of the statistics protocol (ablations/stats.py): fast and deterministic."""

import gc
import math

import numpy as np
import pandas as pd
import pytest

from ablations import stats as S


@pytest.fixture
def no_gc_collect(monkeypatch):
    """statsmodels' multipletests(method="holm") calls gc.collect() on every call (tens of ms in a big process):
    harmless for the analysis (six calls), but thousands of calls in a simulation would take minutes."""
    monkeypatch.setattr(gc, "collect", lambda *args: 0)


def decided(arm, ref, margin, alpha=0.05, power=0.8, **kw):
    """One comparison as a family of one (no Holm)."""
    return S.decide([S.compare(arm, ref, margin=margin, alpha=alpha, **kw)], power=power)[0]


def test_real_effect_is_detected():
    rng = np.random.default_rng(0)
    ref = rng.normal(0.0, 1.0, 10)
    c = decided(rng.normal(3.0, 1.0, 10), ref, margin=0.5)
    assert c.paired and c.verdict == S.DIFFERENCE
    assert c.ci_lo > 0 and c.diff > 2
    assert c.text.startswith("difference detected")


def test_no_effect_with_loose_margin_is_equivalent():
    rng = np.random.default_rng(1)
    ref = rng.normal(0.0, 1.0, 10)  # seed-to-seed spread, shared by both arms
    arm = ref + rng.normal(0.0, 0.01, 10)  # tiny noise, no effect
    c = decided(arm, ref, margin=5 * 0.01)
    assert c.verdict == S.EQUIVALENT, c
    assert c.within_margin and "equivalent within" in c.text


def test_too_few_seeds_is_inconclusive_with_a_recommendation():
    rng = np.random.default_rng(2)
    c = decided(rng.normal(0.0, 1.0, 3), rng.normal(0.0, 1.0, 3), margin=1.0)
    assert c.verdict == S.INCONCLUSIVE
    assert c.seeds_needed > 3 and math.isfinite(c.seeds_needed)
    assert f"about {int(c.seeds_needed)} seeds" in c.text


def test_seeds_needed_matches_statsmodels_power():
    # d = 1 paired (one-sample) t-test at alpha .05, power .8 needs 10 pairs (statsmodels: 9.94)
    assert S.seeds_needed(1.0, 1.0, alpha=0.05, power=0.8, paired=True) == 10
    assert S.seeds_needed(1.0, 1.0, alpha=0.05, power=0.8, paired=False) == 17  # 16.71 per group
    assert S.seeds_needed(1.0, 1e-4, alpha=0.05, power=0.8, paired=True) == math.inf  # capped
    assert math.isnan(S.seeds_needed(math.nan, 1.0, alpha=0.05, power=0.8, paired=True))


def test_false_positive_rate_single_comparison(no_gc_collect):
    rng = np.random.default_rng(3)
    n_sim, hits = 2000, 0
    for _ in range(n_sim):
        seed_effect = rng.normal(0, 1, 5)
        a, b = seed_effect + rng.normal(0, 0.3, 5), seed_effect + rng.normal(0, 0.3, 5)
        c = S.decide([S.compare(a, b, margin=0.1, permutation=False)], power=0.8, plan=False)[0]
        hits += c.verdict == S.DIFFERENCE
    assert 0.02 <= hits / n_sim <= 0.07


def test_family_wise_rate_with_holm(no_gc_collect):
    rng = np.random.default_rng(4)
    n_sim, k = 1000, 5
    any_holm = any_raw = 0
    for _ in range(n_sim):
        ref = rng.normal(0, 1, 5)
        fam = [S.compare(rng.normal(0, 1, 5), ref, margin=0.1, permutation=False) for _ in range(k)]
        any_holm += any(c.verdict == S.DIFFERENCE for c in S.decide(fam, power=0.8, plan=False))
        any_raw += any(c.verdict == S.DIFFERENCE for c in S.decide(fam, power=0.8, adjust=False, plan=False))
    assert any_holm / n_sim <= 0.07
    assert any_raw / n_sim > 0.1  # without the correction the family-wise rate is far above alpha


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    np.testing.assert_allclose(S.holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(S.holm([0.01, math.nan, 0.04]), [0.02, math.nan, 0.04])
    np.testing.assert_allclose(S.holm([0.4, 0.9]), [0.8, 0.9])  # capped at the running max, not above 1


def test_paired_statistics_by_hand():
    ref = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    d = np.array([0.1, 0.3, 0.2, 0.4, 0.5])
    c = S.compare(ref + d, ref, margin=1.0)
    assert c.paired and c.effect_name == "d_z"
    assert c.diff == pytest.approx(0.3)
    assert c.effect == pytest.approx(0.3 / np.std(d, ddof=1))
    assert c.p_perm == pytest.approx(2 / 32)  # exact sign flips: all 5 differences positive
    t = 0.3 / (np.std(d, ddof=1) / math.sqrt(5))
    assert c.t == pytest.approx(t) and c.df == 4


def test_unmatched_seeds_fall_back_to_welch_and_series_align_by_seed():
    ref = pd.Series([1.0, 2.0, 3.0, 4.0, 5.0], index=[0, 1, 2, 3, 4])
    arm = pd.Series([5.5, 1.1, 2.2, 3.3, 4.4], index=[4, 0, 1, 2, 3])  # same seeds, another order
    c = S.compare(arm, ref, margin=1.0)
    assert c.paired and c.diff == pytest.approx(0.3)
    assert c.sd == pytest.approx(np.std([0.1, 0.2, 0.3, 0.4, 0.5], ddof=1))  # differences taken seed by seed
    w = S.compare(pd.Series([1.5, 2.5, math.nan, 4.5], index=[0, 1, 2, 3]), ref, margin=1.0)
    assert not w.paired and w.effect_name == "g" and (w.n_arm, w.n_ref) == (3, 5)
    few = S.decide([S.compare([1.0], ref, margin=1.0)], power=0.8)[0]
    assert few.verdict == S.INCONCLUSIVE and "too few runs" in few.text


def test_gold_at_kl_interpolates():
    kl, gold = [0.0, 1.0, 3.0, 6.0], [0.0, 1.0, 2.0, 4.0]
    assert S.gold_at_kl(kl, gold, 2.0) == pytest.approx(1.5)
    assert S.gold_at_kl(kl, gold, 3.0) == pytest.approx(2.0)
    assert S.gold_at_kl(kl, gold, 4.5) == pytest.approx(3.0)
    assert S.gold_at_kl(kl, gold, 6.0) == pytest.approx(4.0)


def test_gold_at_kl_uses_the_first_crossing():
    kl, gold = [0.0, 4.0, 1.0, 5.0], [0.0, 2.0, -1.0, 3.0]
    assert S.gold_at_kl(kl, gold, 2.0) == pytest.approx(1.0)  # between evals 0 and 1, not 2 and 3 (-> 0.0)
    assert S.gold_at_kl(kl, gold, 4.5) == pytest.approx(-1.0 + 3.5 * 4.0 / 4.0)


def test_gold_at_kl_never_reached_is_nan():
    assert math.isnan(S.gold_at_kl([0.0, 1.0, 1.5, 1.2], [0.0, 0.5, 0.7, 0.6], 2.0))


def test_budget_curve_auc_by_hand():
    assert S.budget_curve_auc([0, 2, 4], [0, 2, 2], 4.0) == pytest.approx(1.5)
    assert S.budget_curve_auc([0, 2], [0, 2], 4.0) == pytest.approx(1.5)  # final gold held beyond the reach
    # first-crossing curve of a non-monotone run: 1/6 + 4/3 on the first segment, 2 * 1.25 on the last one
    assert S.budget_curve_auc([0, 3, 1, 5], [0, 1, -1, 2], 5.0) == pytest.approx(4.0 / 5)
    # only the part up to the largest budget counts
    assert S.budget_curve_auc([0, 2, 10], [0, 2, -8], 2.0) == pytest.approx(1.0)
