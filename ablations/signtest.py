"""The exact sign test of the MEDIAN paired difference, its order-statistic CIs, and one look of protocol v4.

Estimand. The data of one comparison are the per-instance paired differences d_i (i = 1..n), independent across
instances (each its own data, SFT policy, reward model and PPO seeds; seeds are averaged first). The estimand is
θ, the MEDIAN of the per-instance difference: P(d_i <= θ) >= 1/2 and P(d_i >= θ) >= 1/2 for every i -- at least
half of the instances' placement effects lie on either side of θ. (It is the median of the differences, not the
difference of the arms' medians; with ties, e.g. accuracies on a lattice, the median may be an interval and
everything below holds for each of its points.) The point estimate is the sample median.

Why the median and not the mean. No test of the mean can be exact over a nonparametric family: Bahadur & Savage
(1956, Ann. Math. Stat. 27:1115) show that over all distributions with a finite mean, any test of "mean = θ" has
power at most its level against every alternative, so an exact test of the mean needs an assumption (symmetry for
the sign-flip test of ablations/sequential.py; boundedness for concentration bounds). The v3 differences are
skewed (arithmetic Q3 skewness -1.97): the symmetric sign-flip CI of the mean then misses at 3-6x its level
(tests/ablations/test_simulate.py). The sign test needs no shape assumption at all.

The test and its CI (Hollander, Wolfe & Chicken 2014, "Nonparametric Statistical Methods", 3rd ed., §3.4-3.6:
the sign test, its estimator and its order-statistic interval; Pratt & Gibbons 1981, "Concepts of Nonparametric
Theory", ch. 2; David & Nagaraja 2003, "Order Statistics", §7.1; the CI is the set of medians the test does not
reject, Lehmann & Romano 2005, "Testing Statistical Hypotheses", 3rd ed., on confidence sets by test inversion).
With x_(1) <= ... <= x_(n) the sorted data, B ~ Binomial(n, 1/2) and F(j) = P(B <= j), the one-sided level-a rank
is

    k = rank(n, a) = max{k >= 0 : F(k - 1) <= a}          (F(-1) = 0, so k = 0 always qualifies)

and the one-sided (1 - a) bounds are L = x_(k) (lower; -inf when k = 0) and U = x_(n+1-k) (upper; +inf when
k = 0). Coverage: L > θ ⇔ fewer than k of the x_i are <= θ ⇔ N := #{i : x_i <= θ} <= k - 1. Each indicator
[x_i <= θ] is an independent Bernoulli with success probability p_i >= 1/2 (θ is a median of each d_i), so N is
stochastically at least Binomial(n, 1/2) and P(L > θ) = P(N <= k - 1) <= F(k - 1) <= a, with equality when every
d_i is continuous at θ (p_i = 1/2): exact for continuous data, conservative with ties (ties at θ only raise p_i).
Symmetrically P(U < θ) <= a. No symmetry, no common shape, no identical distribution is assumed: only independence
and a common median. The equal-tailed (1 - a) CI is [x_(k1), x_(n+1-k1)] with k1 = rank(n, a/2); the (1 - 2a)
CI, which matches an equivalence test (TOST) at a, is [x_(k2), x_(n+1-k2)] with k2 = rank(n, a). The smallest
reachable one-sided level is F(0) = 2^-n: k >= 1 needs 2^-n <= a.

The p-values are the CI inverted (test-inversion identity, tested): p_greater(δ) = F(#{x_i <= δ}) (H1: θ > δ; ties
at δ counted against H1, the conservative convention), p_less(δ) = F(#{x_i >= δ}); then δ < x_(k) ⇔
p_greater(δ) <= a and δ > x_(n+1-k) ⇔ p_less(δ) <= a. Decisions below are made from these counts, so a
verdict uses comparisons only (no arithmetic on the data) and equals the one read off the printed CI exactly.

One look at nominal level a, margin m > 0 (Schuirmann 1987 TOST; Lakens 2017)
-------------------------------------------------------------------------------
* "material difference": the (1 - a) CI lies beyond the margin: x_(k1) > m or x_(n+1-k1) < -m;
* "equivalent": the (1 - 2a) CI lies inside (-m, m): x_(k2) > -m and x_(n+1-k2) < m; ``nonzero`` when the (1 - a)
  CI also excludes 0 (report text "equivalent; a non-zero difference inside the margin");
* "non-zero, materiality undetermined": the (1 - a) CI excludes 0 and neither of the above;
* "inconclusive" otherwise.
Precedence (the order the report prints): material > equivalent > non-zero > inconclusive. Material and equivalent
cannot both hold (k2 >= k1, so x_(k1) <= x_(k2) <= x_(n+1-k2)), so the precedence only ranks "equivalent" above
"non-zero", which the ``nonzero`` flag keeps visible.

Checks of a comparison at the same look and level a (ablations/rule.py applies them), each one-sided (1 - a) in its
calibrated direction s (+1: the lower bound x_(k2); -1: the upper bound x_(n+1-k2); s = 0: never passes):
* the margin-sized positive control is ``detected`` when its bound excludes 0 (s x_(k2) > 0 for s = +1);
* the penalty ``acts`` when the no-KL contrast's bound lies beyond ITS margin m_e (x_(k2) > m_e for s = +1,
  x_(n+1-k2) < -m_e for s = -1).

Shapes: x (..., n), vectorised over the leading axes (many simulated trials at once); 1-d input gives Python
scalars. Order statistics by np.sort along the last axis; ranks by exact integer arithmetic (cached per (n, a)).
"""

from __future__ import annotations

import functools
import itertools
import math
from fractions import Fraction

import numpy as np

MATERIAL = "material difference"
EQUIVALENT = "equivalent"
NONZERO = "non-zero, materiality undetermined"
INCONCLUSIVE = "inconclusive"
INSENSITIVE = "insensitive"  # an equivalence whose margin-sized positive control was not detected
INERT = "inert"  # an equivalence where the penalty was not shown to act (the no-KL contrast within its margin)
PRECEDENCE = (MATERIAL, EQUIVALENT, NONZERO, INCONCLUSIVE)
SETTLING = (MATERIAL, EQUIVALENT)
LABELS = {
    INERT: "the penalty is inert here: placement is not testable at this β",
    INSENSITIVE: "insensitive: the margin-sized positive control was not detected",
}
NONZERO_EQUIVALENT = "equivalent; a non-zero difference inside the margin"
_WIDTH = "<U40"


# ---------------------------------------------------------------- ranks


@functools.lru_cache(maxsize=8192)
def rank(n: int, a: float) -> int:
    """k = max{k >= 0 : P(Binomial(n, 1/2) <= k - 1) <= a}: the one-sided (1 - a) lower bound is x_(k), the upper
    x_(n+1-k) (k = 0: infinite). Exact: sum_{i<k} C(n, i) <= a 2^n compared in integers and the float a's exact
    rational value, so a level equal to an attainable one (a = F(j)) gives k = j + 1, never a rounding."""
    n = int(n)
    if n < 1:
        raise ValueError(f"need at least one instance (n = {n})")
    if not 0 <= a < 0.5:
        raise ValueError(f"one-sided level must be in [0, 1/2) (got {a})")
    bound = Fraction(a) * 2**n
    k, total = 0, 0
    while k < n:
        total += math.comb(n, k)  # 2^n F(k): F(k) <= a lets k + 1 qualify
        if total > bound:
            break
        k += 1
    return k


def attained(n: int, k: int) -> float:
    """The attained one-sided level F(k - 1) = P(Binomial(n, 1/2) <= k - 1) of the rank-k bound (0 for k = 0)."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


def reachable(n: int, a: float) -> bool:
    """Whether a one-sided level-a bound can be finite at n: 2^-n <= a (rank(n, a) >= 1)."""
    return a > 0 and rank(n, a) >= 1


# ---------------------------------------------------------------- helpers


def as_data(x) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError("need data of shape (..., n) with n >= 1")
    if not np.isfinite(x).all():
        raise ValueError("the per-instance differences must be finite (complete instances only)")
    return x


def scalar(v):
    """0-d arrays and numpy scalars to Python scalars (1-d input gives plain floats, bools and strings)."""
    if isinstance(v, np.ndarray) and v.ndim == 0:
        return v.item()
    if isinstance(v, np.generic):
        return v.item()
    return v


def order_bounds(xs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(x_(k), x_(n+1-k)) of SORTED data xs (..., n); (-inf, +inf) for k = 0."""
    n = xs.shape[-1]
    if k == 0:
        return np.full(xs.shape[:-1], -np.inf), np.full(xs.shape[:-1], np.inf)
    return xs[..., k - 1], xs[..., n - k]


def sorted_median(xs: np.ndarray) -> np.ndarray:
    """The sample median of SORTED data xs (..., n) (the mean of the two middle values for even n)."""
    n = xs.shape[-1]
    return 0.5 * (xs[..., (n - 1) // 2] + xs[..., n // 2])


# ---------------------------------------------------------------- CIs, p-values, one-sided checks


def bounds(x, a: float) -> tuple:
    """One-sided (1 - a) bounds (x_(k), x_(n+1-k)), k = rank(n, a), of the median of x (..., n); together the
    (1 - 2a) CI. Coverage >= 1 - a each for independent data with common median θ (module docstring)."""
    x = as_data(x)
    lo, hi = order_bounds(np.sort(x, axis=-1), rank(x.shape[-1], a))
    return scalar(lo), scalar(hi)


def median_ci(x, level: float) -> tuple:
    """Equal-tailed order-statistic CI of the median at confidence ``level``: bounds(x, (1 - level) / 2)."""
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1) (got {level})")
    return bounds(x, (1 - level) / 2)


@functools.lru_cache(maxsize=256)
def _binom_table(n: int) -> np.ndarray:
    """F(0..n) of Binomial(n, 1/2), each the correctly rounded float of an exact integer ratio (a numpy cumsum of
    the C(n, i) overflows int64 from n = 63 on: F came out negative at n = 64, look 16's sign p)."""
    return np.array([total / 2**n for total in itertools.accumulate(math.comb(n, i) for i in range(n + 1))])


def _binom_cdf(n: int, counts: np.ndarray) -> np.ndarray:
    return _binom_table(int(n))[counts]


def sign_p(x, delta=0.0, alternative: str = "two-sided"):
    """Exact sign-test p-value of H0: median = ``delta`` (broadcast over the leading axes of x (..., n)):
    "greater" (H1: θ > δ) F(#{x_i <= δ}), "less" F(#{x_i >= δ}), "two-sided" min(1, 2 min(both)); F the
    Binomial(n, 1/2) CDF; ties at δ count against H1. Inverts bounds() and median_ci() exactly."""
    x = as_data(x)
    n = x.shape[-1]
    d = np.asarray(delta, dtype=float)[..., None]
    greater = _binom_cdf(n, (x <= d).sum(axis=-1))
    less = _binom_cdf(n, (x >= d).sum(axis=-1))
    if alternative == "greater":
        p = greater
    elif alternative == "less":
        p = less
    elif alternative == "two-sided":
        p = np.minimum(1.0, 2 * np.minimum(greater, less))
    else:
        raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided' (got {alternative!r})")
    return scalar(p)


def _check_direction(direction: int) -> None:
    if direction not in (1, 0, -1):
        raise ValueError(f"direction must be +1, -1 or 0 (got {direction})")


def _count(mask: np.ndarray, cumulative: bool) -> np.ndarray:
    return np.cumsum(mask, axis=-1, dtype=np.int32) if cumulative else mask.sum(axis=-1)


def side_counts(x: np.ndarray, threshold: float, cumulative: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(#{x_i <= t}, #{x_i >= -t}) over the last axis of x (..., n) (``cumulative``: of every prefix, (..., n)):
    the counts beyond_counts() needs for either direction."""
    return _count(x <= threshold, cumulative), _count(x >= -threshold, cumulative)


def beyond_counts(le: np.ndarray, ge: np.ndarray, k: int, direction: int) -> np.ndarray:
    """The one-sided bound of rank k lies beyond direction · t, from counts le = #{x_i <= t} (direction +1: x_(k) > t
    ⇔ le <= k - 1) or ge = #{x_i >= -t} (direction -1: x_(n+1-k) < -t ⇔ ge <= k - 1); direction 0: never."""
    if direction == 0:
        return np.zeros(np.shape(le), dtype=bool)
    return (le if direction > 0 else ge) <= k - 1


def beyond(x, a: float, direction: int, threshold: float = 0.0):
    """Whether the one-sided (1 - a) bound of the median of x (..., n) in ``direction`` lies beyond
    ``direction`` · ``threshold``: +1 x_(k) > t, -1 x_(n+1-k) < -t (k = rank(n, a)); 0 never (a calibrated direction
    of 0 can never be confirmed)."""
    _check_direction(direction)
    x = as_data(x)
    return scalar(beyond_counts(*side_counts(x, threshold), rank(x.shape[-1], a), direction))


def detected(x, a: float, direction: int):
    """Positive control at level a: its one-sided (1 - a) bound excludes 0 in its calibrated ``direction``."""
    return beyond(x, a, direction, 0.0)


def acts(x, a: float, direction: int, margin: float):
    """The penalty acts: the no-KL contrast's one-sided (1 - a) bound lies beyond its own ``margin`` in its
    calibrated ``direction`` (+1: x_(k) > margin; -1: x_(n+1-k) < -margin)."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0 (got {margin})")
    return beyond(x, a, direction, margin)


# ---------------------------------------------------------------- one look


def margin_counts(x: np.ndarray, margin: float, cumulative: bool = False) -> dict[str, np.ndarray]:
    """Counts that decide a look, over the last axis of x (..., n): ``le<t>`` / ``ge<t>`` = #{x_i <= t} / #{x_i >= t}
    at t = -m, 0, +m (keys "le-m", "ge-m", "le0", "ge0", "le+m", "ge+m"). ``cumulative``: the counts of every prefix
    x[..., :i+1] instead, shape (..., n) (how ablations/rule.py gets every look at once)."""
    return {
        f"{op}{name}": _count((x <= t) if op == "le" else (x >= t), cumulative)
        for name, t in (("-m", -margin), ("0", 0.0), ("+m", margin))
        for op in ("le", "ge")
    }


def classify(c: dict[str, np.ndarray], k1: int, k2: int) -> dict[str, np.ndarray]:
    """Verdict from margin_counts() and the ranks k1 = rank(n, a/2), k2 = rank(n, a) (module docstring, with the
    precedence material > equivalent > non-zero > inconclusive). Returns ``verdict``, ``nonzero`` (an equivalence
    whose (1 - a) CI excludes 0) and ``side`` (+1 / -1 when the (1 - a) CI lies above / below 0, else 0)."""
    above0, below0 = c["le0"] <= k1 - 1, c["ge0"] <= k1 - 1  # x_(k1) > 0, x_(n+1-k1) < 0
    material = (c["le+m"] <= k1 - 1) | (c["ge-m"] <= k1 - 1)  # x_(k1) > m or x_(n+1-k1) < -m
    equivalent = (c["le-m"] <= k2 - 1) & (c["ge+m"] <= k2 - 1)  # x_(k2) > -m and x_(n+1-k2) < m
    excludes0 = above0 | below0
    verdict = np.where(
        material, MATERIAL, np.where(equivalent, EQUIVALENT, np.where(excludes0, NONZERO, INCONCLUSIVE))
    ).astype(_WIDTH)
    side = np.where(above0, 1, np.where(below0, -1, 0))
    return {"verdict": verdict, "nonzero": equivalent & ~material & excludes0, "side": side}


def outcome(x, margin: float, a: float) -> dict:
    """One comparison at one look at nominal level ``a`` (0 <= a < 1; a = 0: a look that spends nothing) with
    margin ``margin`` > 0, x (..., n). Returns ``n``, ``k1``/``k2`` (ranks at a/2 and a), ``estimate`` (sample
    median), ``lo``/``hi`` (the (1 - a) CI), ``lo90``/``hi90`` (the (1 - 2a) CI; names kept from v3), ``verdict``,
    ``nonzero``, ``side`` (classify())."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0 (got {margin})")
    x = as_data(x)
    n = x.shape[-1]
    k1, k2 = rank(n, a / 2), rank(n, a)
    xs = np.sort(x, axis=-1)
    (lo, hi), (lo90, hi90) = order_bounds(xs, k1), order_bounds(xs, k2)
    out = {"n": n, "k1": k1, "k2": k2, "estimate": sorted_median(xs), "lo": lo, "hi": hi, "lo90": lo90, "hi90": hi90}
    out |= classify(margin_counts(x, margin), k1, k2)
    return {key: scalar(v) for key, v in out.items()}


def label(verdict: str, nonzero: bool = False) -> str:
    """The report's text for a verdict: "equivalent; a non-zero difference inside the margin" for a non-zero
    equivalence; the inert and insensitive sentences (an equivalence withheld by a check), with "; non-zero (the CI
    excludes 0)" when its (1 - a) CI excludes 0 -- that claim needs no check; else the verdict itself."""
    if verdict == EQUIVALENT and nonzero:
        return NONZERO_EQUIVALENT
    text = LABELS.get(verdict, verdict)
    return f"{text}; non-zero (the CI excludes 0)" if nonzero and verdict in LABELS else text
