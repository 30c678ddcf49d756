"""rliable's interval estimates beside the primary tests (ablations/primary.py): P(X > Y) and the IQM as rliable
defines them, checked against hand-computed values, and the bootstrap CIs' shape."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ablations.primary import beside_rliable, iqm, probability_of_improvement


def test_probability_of_improvement_by_hand():
    # X = [1, 2, 3], Y = [2, 2, 0]: pairs (x, y) with x > y: 1>0, 2>0, 3>2, 3>2, 3>0 = 5; ties: 2=2 twice = 2 x 1/2
    # P = (5 + 1) / 9 = 2/3 (the Mann-Whitney U of X over Y, 6, divided by 3 x 3)
    assert probability_of_improvement([1, 2, 3], [2, 2, 0]) == pytest.approx(2 / 3)
    assert probability_of_improvement([2, 2, 0], [1, 2, 3]) == pytest.approx(1 / 3)  # the two add up to 1
    assert probability_of_improvement([1, 1], [1, 1]) == 0.5  # identical: 1/2 (rliable's special case)
    assert probability_of_improvement([5], [1, 2]) == 1.0


def test_probability_of_improvement_equals_scipys_mann_whitney_u_over_nm():
    from scipy.stats import mannwhitneyu

    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 4, 7).astype(float), rng.integers(0, 4, 5).astype(float)  # with ties
    u = mannwhitneyu(x, y, alternative="greater").statistic  # what rliable divides by n_x n_y
    assert probability_of_improvement(x, y) == pytest.approx(u / (7 * 5))


def test_iqm_is_the_25_percent_trimmed_mean():
    assert iqm(np.array([0.0, 1, 2, 3, 4, 5, 6, 100])) == pytest.approx(3.5)  # drops 0, 1 and 6, 100
    assert iqm(np.array([[1.0, 2, 3, 4], [0, 0, 4, 4]]), axis=-1) == pytest.approx([2.5, 2.0])


def test_beside_rliable_gives_each_statistic_with_a_ci_around_it():
    a = np.array([0.5, 0.7, 0.6, 0.9, 0.8, 0.4, 0.75, 0.65])
    b = a - np.array([0.1, 0.2, 0.05, 0.15, 0.1, 0.0, 0.2, 0.1])
    out = beside_rliable(a, b)
    assert out["boot_mean"] == pytest.approx(np.mean(a - b))
    assert out["p_improve"] == pytest.approx(probability_of_improvement(a, b))
    for k in ("boot_mean", "boot_iqm", "p_improve"):
        assert out[f"{k}_lo"] <= out[k] <= out[f"{k}_hi"], (k, out)
    assert out["boot_mean_lo"] > 0  # every instance improves or ties: the mean difference's CI excludes 0
    assert out == beside_rliable(a, b)  # seeded: the report is reproducible
    empty = beside_rliable(np.array([]), np.array([]))
    assert math.isnan(empty["boot_mean"]) and math.isnan(empty["p_improve_hi"])


def test_the_reports_rliable_clause_signs_differences_but_not_probabilities():
    from ablations.report import _rliable

    r = {"contrast": "loss_k3 − reward_k3", "boot_mean_lo": -0.5, "boot_mean_hi": -0.25, "boot_iqm": -0.4}
    r |= {"boot_iqm_lo": -0.5, "boot_iqm_hi": -0.3, "p_improve": 0.117, "p_improve_lo": 0.025, "p_improve_hi": 0.237}
    assert _rliable(r) == (
        "; rliable: bootstrap 95% CI of mean Δ [-0.500, -0.250], IQM Δ -0.400 [-0.500, -0.300], "
        "P(loss_k3 > reward_k3) 0.117 [0.025, 0.237]"
    )
    assert _rliable({"contrast": "a − b"}) == ""  # reports computed before the rliable columns
