"""ablations/signtest.py: the exact sign test of the median and its order-statistic CIs, by hand, against scipy and a
brute-force enumeration of sign patterns, by simulated coverage on skewed continuous and lattice (tied) data, and
the one-look verdicts by hand."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from ablations import signtest as T

# ---------------------------------------------------------------- the rank


@pytest.mark.parametrize(
    "n, a, k",
    [
        (5, 1 / 32, 1),  # F(0) = 1/32 <= a exactly: reachable at the boundary
        (5, 0.999 / 32, 0),  # just below 2^-5: no finite bound
        (10, 0.025, 2),  # F(1) = 11/1024 = 0.0107 <= 0.025 < F(2) = 56/1024: the textbook 95% CI [x_(2), x_(9)]
        (10, 11 / 1024, 2),  # a equal to an attainable level F(1)
        (24, 0.025, 7),  # F(6) = 0.0113, F(7) = 0.0320: the 95% CI [x_(7), x_(18)]
        (1, 0.4, 0),
        (3, 0.0, 0),  # a level of 0 (a look that spends nothing)
    ],
)
def test_rank_by_hand(n, a, k):
    """k = max{k : P(Bin(n, 1/2) <= k - 1) <= a}. Catches: k off by one (F(k) <= a), a float comparison that misses
    an attainable level (a = F(j) exactly), the lower bound's rank from the two-sided level."""
    assert T.rank(n, a) == k
    if k:
        assert T.attained(n, k) <= a < T.attained(n, k + 1)


def test_rank_against_scipy():
    """For n = 1..60 and several levels: F(k - 1) <= a < F(k) with F from scipy.stats.binom and from
    scipy.stats.binomtest's exact one-sided p-value (an independent implementation); reachable iff 2^-n <= a."""
    for n in range(1, 61):
        for a in (0.0005, 0.001389, 0.0025, 0.005, 0.025, 0.05, 0.25):
            k = T.rank(n, a)
            assert k == 0 or stats.binom.cdf(k - 1, n, 0.5) <= a * (1 + 1e-12)
            assert stats.binom.cdf(k, n, 0.5) > a
            if k:
                assert stats.binomtest(k - 1, n, 0.5, alternative="less").pvalue <= a * (1 + 1e-12)
            assert stats.binomtest(k, n, 0.5, alternative="less").pvalue > a
            assert T.reachable(n, a) == (2.0**-n <= a)
    with pytest.raises(ValueError):
        T.rank(10, 0.5)
    with pytest.raises(ValueError):
        T.rank(0, 0.05)


@pytest.mark.parametrize("n", [6, 9, 12])
def test_rank_by_enumerating_every_sign_pattern(n):
    """All 2^n sign patterns of x = θ + s |y| (fixed distinct magnitudes: a continuous, median-θ law, each pattern
    equally likely): the lower bound x_(k) misses θ in exactly a fraction F(k - 1) <= a of them, and x_(k+1) would
    miss in more than a -- k is the largest exact rank. The upper bound mirrors it. Catches: a rank that is not the
    largest valid one (power lost), or too large (level broken), lower and upper ranks swapped."""
    theta = 0.3
    y = np.abs(np.random.default_rng(n).normal(size=n)) + 0.05
    signs = np.array(list(itertools.product((-1, 1), repeat=n)))
    xs = np.sort(theta + signs * y, axis=1)
    for a in (0.01, 0.05, 0.1, 0.2):
        k = T.rank(n, a)
        miss_lo = (xs[:, k - 1] > theta).mean() if k else 0.0
        miss_hi = (xs[:, n - k] < theta).mean() if k else 0.0
        assert miss_lo == pytest.approx(T.attained(n, k), abs=1e-15) and miss_lo <= a
        assert miss_hi == pytest.approx(miss_lo, abs=1e-15)
        assert (xs[:, k] > theta).mean() > a  # rank k + 1 breaks the level


# ---------------------------------------------------------------- CIs and p-values by hand


def test_order_statistic_cis_by_hand():
    """x = [3, 1, 2, 5, 4] (sorted 1..5), n = 5: F(0) = 1/32, F(1) = 6/32, F(2) = 16/32. Level 0.75 two-sided cuts
    a/2 = 0.125 per side: k = 1, CI [1, 5]; 0.5 cuts 0.25: k = 2, [2, 4]; 0.95 cuts 0.025 < 1/32: k = 0, infinite.
    Even n = 4 at 0.75 (0.125 >= 1/16): k = 1, [1, 4], median 2.5. Vectorised rows each as alone."""
    x = np.array([3.0, 1.0, 2.0, 5.0, 4.0])
    assert T.median_ci(x, 0.75) == (1.0, 5.0)
    assert T.median_ci(x, 0.5) == (2.0, 4.0)
    assert T.median_ci(x, 0.95) == (-math.inf, math.inf)
    assert T.bounds(x, 0.25) == (2.0, 4.0)
    assert T.median_ci(np.array([4.0, 1.0, 3.0, 2.0]), 0.75) == (1.0, 4.0)
    assert T.outcome(np.array([4.0, 1.0, 3.0, 2.0]), 1.0, 0.25)["estimate"] == 2.5
    lo, hi = T.median_ci(np.stack([x, -x, x + 10]), 0.5)
    np.testing.assert_array_equal(lo, [2.0, -4.0, 12.0])
    np.testing.assert_array_equal(hi, [4.0, -2.0, 14.0])


def test_sign_p_by_hand_and_against_binomtest():
    """p_greater(δ) = F(#{x <= δ}): x = 1..5 at δ = 0 is F(0) = 1/32; at δ = 2 it is F(2) = 1/2 (ties at δ count
    against H1); two-sided doubles the smaller side. For continuous data it equals scipy's binomtest on the count
    above δ. Catches: ties dropped (anti-conservative), alternative flipped."""
    x = np.arange(1.0, 6.0)
    assert T.sign_p(x, 0.0, "greater") == 1 / 32
    assert T.sign_p(x, 0.0, "less") == 1.0
    assert T.sign_p(x, 0.0) == 2 / 32
    assert T.sign_p(x, 2.0, "greater") == 0.5
    assert T.sign_p(x, 2.0, "less") == 31 / 32  # #{x >= 2} = 4: F(4)
    rng = np.random.default_rng(3)
    z = rng.normal(0.4, 1.0, 15)
    for delta in (-0.5, 0.1, 0.35, 1.2):
        above = int((z > delta).sum())
        assert T.sign_p(z, delta, "greater") == pytest.approx(stats.binomtest(above, 15, 0.5, "greater").pvalue)
        assert T.sign_p(z, delta, "less") == pytest.approx(stats.binomtest(above, 15, 0.5, "less").pvalue)


@pytest.mark.parametrize("n", [62, 63, 64, 65, 200])
def test_sign_p_at_large_n_against_binomtest(n):
    """At n = 63 and 64 the binomial table's integer sums pass 2^63 (the defect of look 16: a numpy int64 cumsum
    wrapped and the reported sign p of grammar's n = 64 rows came out negative). Every p lies in [0, 1] and equals
    scipy's binomtest, on both sides and two-sided, from all-below to all-above."""
    for above in (0, 1, n // 4, n // 2, n - 3, n):
        x = np.r_[np.full(above, 1.0), np.full(n - above, -1.0)]
        for alternative in ("greater", "less", "two-sided"):
            p = T.sign_p(x, 0.0, alternative)
            assert 0.0 <= p <= 1.0
            assert p == pytest.approx(stats.binomtest(above, n, 0.5, alternative).pvalue, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("n", [7, 16])
def test_test_inversion_identity_with_ties(n):
    """On lattice data (ties) and a grid of δ that includes every data value: δ < x_(k) ⇔ p_greater(δ) <= a,
    δ > x_(n+1-k) ⇔ p_less(δ) <= a, outside the (1 - a) CI ⇔ two-sided p <= a. Catches: strict vs non-strict
    counts at ties, a p-value and a CI from different ranks."""
    x = np.random.default_rng(n).integers(-3, 6, n).astype(float)
    grid = np.concatenate([np.unique(x), np.linspace(-5, 8, 131)])
    xb = np.broadcast_to(x, (len(grid), n))
    for a in (0.01, 0.05, 0.2):
        lo, hi = T.bounds(x, a)
        np.testing.assert_array_equal(grid < lo, T.sign_p(xb, grid, "greater") <= a)
        np.testing.assert_array_equal(grid > hi, T.sign_p(xb, grid, "less") <= a)
        lo2, hi2 = T.median_ci(x, 1 - a)
        np.testing.assert_array_equal((grid < lo2) | (grid > hi2), T.sign_p(xb, grid) <= a)


# ---------------------------------------------------------------- coverage by simulation

COVERAGE_TRIALS = 20000


def _draws(law: str, rng, shape):
    """(data, a median θ) of skewed continuous and lattice laws, one row per trial."""
    if law == "exponential":  # skewness 2, median ln 2
        return rng.exponential(1.0, shape), math.log(2)
    if law == "lognormal":  # skewness ~6, median 1
        return rng.lognormal(0.0, 1.0, shape), 1.0
    if law == "poisson":  # lattice, median 1 with an atom at it: P(X <= 1) = 0.844, P(X >= 1) = 0.503
        return rng.poisson(0.7, shape).astype(float), 1.0
    if law == "bernoulli":  # every θ in [0, 1] is a median; 0.5 is the worst case (no atom, both sides 1/2)
        return (rng.random(shape) < 0.5).astype(float), 0.5
    if law == "heteroscedastic":  # independent, not identically distributed, common median 0, skewed
        scale = np.linspace(0.2, 5.0, shape[-1])
        return scale * (rng.exponential(1.0, shape) - math.log(2)), 0.0
    raise ValueError(law)


@pytest.mark.parametrize("law", ["exponential", "lognormal", "poisson", "bernoulli", "heteroscedastic"])
@pytest.mark.parametrize("n", [12, 24])
def test_one_sided_coverage_on_skewed_and_lattice_data(law, n):
    """Each one-sided (1 - a) bound misses the median in at most a of 20,000 trials (+3 Monte Carlo SEs), with the
    exact rate F(k - 1) for continuous laws (within 4 SEs) -- skewed, lattice with ties, and non-identically
    distributed data alike. The sign-flip CI of the MEAN fails the first two (tests/ablations/test_simulate.py
    shows it on the task's own data)."""
    rng = np.random.default_rng([n, *map(ord, law)])  # seeded by the case (str hash() is salted per process)
    x, theta = _draws(law, rng, (COVERAGE_TRIALS, n))
    for a in (0.005, 0.025):
        lo, hi = T.bounds(x, a)
        bound = a + 3 * math.sqrt(a * (1 - a) / COVERAGE_TRIALS)
        miss_lo, miss_hi = (lo > theta).mean(), (hi < theta).mean()
        assert miss_lo <= bound and miss_hi <= bound, (miss_lo, miss_hi)
        if law in ("exponential", "lognormal", "heteroscedastic"):
            exact = T.attained(n, T.rank(n, a))
            tol = 4 * math.sqrt(exact * (1 - exact) / COVERAGE_TRIALS)
            assert abs(miss_lo - exact) <= tol and abs(miss_hi - exact) <= tol


# ---------------------------------------------------------------- one look


@pytest.mark.parametrize(
    "x, margin, verdict, nonzero, side",
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.9, T.MATERIAL, False, 1),  # (1-a) CI [1, 5] beyond 0.9
        ([1.0, 2.0, 3.0, 4.0, 5.0], 4.5, T.EQUIVALENT, True, 1),  # (1-2a) CI [2, 4] inside 4.5; [1, 5] excludes 0
        ([1.0, 2.0, 3.0, 4.0, 5.0], 3.5, T.NONZERO, False, 1),  # hi90 = 4 >= 3.5: not equivalent
        ([1.0, 2.0, 3.0, 4.0, 5.0], 1.5, T.NONZERO, False, 1),  # lo = 1 < 1.5 < lo90 = 2: not material
        ([-5.0, -4.0, -3.0, -2.0, -1.0], 0.9, T.MATERIAL, False, -1),  # the other side
        ([-1.0, 2.0, 3.0, 4.0, 5.0], 4.5, T.EQUIVALENT, False, 0),  # [2, 4] inside; [-1, 5] holds 0
        ([-1.0, 2.0, 3.0, 4.0, 5.0], 3.0, T.INCONCLUSIVE, False, 0),
        ([1.0, 1.0, 1.0, 1.0, 1.0], 1.0, T.NONZERO, False, 1),  # ties at the margin: 1 > 1 and 1 < 1 are false
    ],
)
def test_verdicts_by_hand(x, margin, verdict, nonzero, side):
    """a = 0.25 at n = 5: the (1 - a) CI is [x_(1), x_(5)] (k1 = rank(5, 0.125) = 1), the (1 - 2a) CI [x_(2), x_(4)]
    (k2 = 2). Catches: TOST on the (1 - a) CI (the 4.5 row), material judged on the (1 - 2a) CI (the 1.5 row) or
    against 0, non-strict comparisons at the margin (the tied row), the non-zero flag dropped, the precedence."""
    o = T.outcome(np.array(x), margin, 0.25)
    assert (o["k1"], o["k2"]) == (1, 2)
    assert (o["verdict"], o["nonzero"], o["side"]) == (verdict, nonzero, side)
    assert isinstance(o["verdict"], str) and isinstance(o["lo"], float)
    assert T.label(o["verdict"], o["nonzero"]) == (
        "equivalent; a non-zero difference inside the margin" if nonzero else verdict
    )


def test_counts_give_the_verdict_read_off_the_cis():
    """classify() decides from counts (comparisons only); the same verdict read off the printed order-statistic CIs
    agrees on 4,000 lattice rows with many ties at 0 and at ±m, at several levels. Catches: an off-by-one between
    the count rule and the order statistic, a precedence that differs from the documented one."""
    rng = np.random.default_rng(7)
    x = rng.integers(-6, 7, (4000, 13)) / 4.0  # ties at 0 and at the margins ±1
    for a in (0.0, 0.004, 0.02, 0.1):
        o = T.outcome(x, 1.0, a)
        lo, hi, lo90, hi90 = (np.asarray(o[k]) for k in ("lo", "hi", "lo90", "hi90"))
        material = (lo > 1) | (hi < -1)
        equivalent = (lo90 > -1) & (hi90 < 1)
        excludes0 = (lo > 0) | (hi < 0)
        want = np.select([material, equivalent, excludes0], [T.MATERIAL, T.EQUIVALENT, T.NONZERO], T.INCONCLUSIVE)
        np.testing.assert_array_equal(o["verdict"], want)
        np.testing.assert_array_equal(o["nonzero"], equivalent & ~material & excludes0)
        assert a == 0 or len(np.unique(want)) >= 3


def test_detected_and_acts_by_hand():
    """Control x = 1..5 at a = 0.25 (k = 2): lower bound 2 > 0 detected upwards, never downwards; direction 0 never.
    The penalty acts when the bound is beyond ITS margin: 2 > 1.5 yes, 2 > 2 no; -x with direction -1 mirrors it.
    Catches: the bound at the two-sided rank (k = 1, bound 1), direction ignored, a direction of 0 treated as
    "any", the margin compared non-strictly."""
    x = np.arange(1.0, 6.0)
    assert T.detected(x, 0.25, +1) and not T.detected(x, 0.25, -1) and not T.detected(x, 0.25, 0)
    assert T.detected(-x, 0.25, -1)
    assert T.acts(x, 0.25, +1, 1.5) and not T.acts(x, 0.25, +1, 2.0) and T.acts(x, 0.25, +1, 1.99)
    assert T.acts(-x, 0.25, -1, 1.5) and not T.acts(-x, 0.25, +1, 1.5) and not T.acts(x, 0.25, 0, 0.1)
    assert not T.detected(x, 0.02, +1)  # 2^-5 = 0.031 > 0.02: k = 0, never
    with pytest.raises(ValueError):
        T.detected(x, 0.25, 2)
