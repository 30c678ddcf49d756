"""Statistics for few-replicate comparisons of KL variants: paired tests across independent task instances.

The unit of analysis is the task instance (its own data, SFT and reward model); PPO seeds nested in an instance are
averaged first. Every arm runs on the same instances, so a comparison is a one-sample analysis of the per-instance
differences d_i (i = 1..n). Everything here is vectorised over leading axes so that the simulation tests exercise
exactly the code the analysis uses.

* Paired t (Student 1908): mean d, SD, df = n - 1, two-sided p, the (1 - alpha) CI for the difference test and the
  (1 - 2 alpha) CI that matches an equivalence test at alpha (Schuirmann 1987: TOST at alpha rejects exactly when
  the 90% CI lies inside (-margin, margin)).
* TOST (Schuirmann 1987, J. Pharmacokinet. Biopharm. 15:657; Lakens 2017, Soc. Psychol. Personal. Sci. 8:355):
  p = max(P(T > (mean + margin)/se), P(T < (mean - margin)/se)); checked against statsmodels ttost_paired in tests.
* One-sided tests against a shifted null (Q1 restraint on the log KL ratio).
* Exact sign-flip permutation tests (Fisher 1935; Good 2005 "Permutation, Parametric and Bootstrap Tests of
  Hypotheses" ch. 3): all 2^n sign vectors up to EXACT_FLIPS, else FLIP_RESAMPLES random ones. Their floor is
  2/2^n (two-sided) or 1/2^n (one-sided): a family of m tests cannot reach alpha after Holm when the floor is at
  least alpha/m.
* A studentized sign-flip test of a vector of within-instance contrasts (the factorial effects): statistic
  sum_j t_j^2 with each component studentized by its own SD, so unequal variances across cells do not matter;
  valid when the contrast vector is symmetric about 0 under H0 (Pesarin & Salmaso 2010 "Permutation Tests for
  Complex Data" ch. 4; Janssen 1997, Stat. Probab. Lett. 36:9, for studentized permutation statistics).
* Holm (1979) step-down within a family (as statsmodels multipletests(method="holm"); its default is Holm-Sidak).
* Power from the noncentral t: two-sided paired t exactly (as statsmodels TTestPower), TOST by the lower bound
  P(A and B) >= P(A) + P(B) - 1 (Phillips 1990, J. Pharmacokinet. Biopharm. 18:137), both at a given alpha and
  for the OBSERVED difference and SD, which gives "instances needed" to show the difference and to show
  equivalence (out of reach when the observed difference is at or beyond the margin).
* Clopper & Pearson (1934) exact binomial CI (scipy binomtest(...).proportion_ci(method="exact")).
* Bimodality flag: Engelman & Hartigan (1969, JASA 64:1647) two-cluster test, max over ordered splits of
  between-SS / total SS, p-value from a Monte Carlo normal null of the same n.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

DIFFERENCE, EQUIVALENT, INCONCLUSIVE = "difference", "equivalent", "inconclusive"
RESTRAINS, NO_RESTRAINT = "restrains", "does not restrain"
MAX_INSTANCES = 1000  # above this "instances needed" is reported as out of reach
EXACT_FLIPS = 2**16  # enumerate every sign vector up to this many, else sample FLIP_RESAMPLES
FLIP_RESAMPLES = 9999
NULL_DRAWS = 20000  # Monte Carlo draws of the bimodality statistic's normal null (per n, cached)


# ---------------------------------------------------------------- paired t, TOST, one-sided


def paired(d, *, margin: float, alpha: float) -> dict[str, np.ndarray]:
    """Paired t-test and TOST of per-instance differences ``d`` (shape (..., n), complete rows).

    Returns arrays over the leading axes: ``n``, ``mean``, ``sd`` (ddof 1), ``se``, ``df``, ``t``, ``p`` (two-sided,
    H0: mean = 0), ``ci95`` / ``ci90`` as (lo, hi) pairs -- the (1 - alpha) and (1 - 2 alpha) CIs (names assume
    alpha = 0.05) -- and ``p_tost`` (H0: |mean| >= margin). A zero SD gives an infinite t: the difference is then
    called exactly (p 0 or NaN for a zero mean) and TOST p is 0 inside the margin, 1 outside.
    """
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]
    df = n - 1
    mean = d.mean(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        sd = d.std(axis=-1, ddof=1) if n > 1 else np.full(mean.shape, np.nan)
        se = sd / math.sqrt(n)
        t = mean / se
        p = 2 * stats.t.sf(np.abs(t), df) if df > 0 else np.full(mean.shape, np.nan)
        q95, q90 = (stats.t.ppf(1 - a, df) if df > 0 else np.nan for a in (alpha / 2, alpha))
        p_lo = stats.t.sf((mean + margin) / se, df)  # H0: mean <= -margin
        p_hi = stats.t.cdf((mean - margin) / se, df)  # H0: mean >= +margin
        p_tost = np.maximum(p_lo, p_hi) if df > 0 else np.full(mean.shape, np.nan)
    return {
        "n": np.full(mean.shape, n),
        "mean": mean,
        "sd": sd,
        "se": se,
        "df": np.full(mean.shape, float(df)),
        "t": t,
        "p": p,
        "ci95": (mean - q95 * se, mean + q95 * se),
        "ci90": (mean - q90 * se, mean + q90 * se),
        "p_tost": p_tost,
    }


def ci(d, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided t CI of the mean of ``d`` (shape (..., n)) at confidence ``level``."""
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]
    mean = d.mean(axis=-1)
    if n < 2:
        return np.full(mean.shape, np.nan), np.full(mean.shape, np.nan)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * d.std(axis=-1, ddof=1) / math.sqrt(n)
    return mean - half, mean + half


def shifted_one_sided(d, *, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided paired t-tests of the mean of ``d`` (..., n) against -``shift``: returns (p_below, p_above),
    p_below testing H0: mean >= -shift (evidence the mean is below -shift), p_above H0: mean <= -shift."""
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]
    if n < 2:
        nan = np.full(d.shape[:-1], np.nan)
        return nan, nan
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (d.mean(axis=-1) + shift) / (d.std(axis=-1, ddof=1) / math.sqrt(n))
    return stats.t.cdf(t, n - 1), stats.t.sf(t, n - 1)


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm (1979) step-down adjusted p-values: sorted ascending, p_(j) * (m - j + 1), running maximum, capped at 1.
    NaN entries are left out of the family and stay NaN. Written out because statsmodels' multipletests calls
    gc.collect() on every call (0.2 s in a large process); tests check it against multipletests(method="holm")."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    return out


def verdict(p_holm: float, p_tost_holm: float, alpha: float) -> str:
    """ "difference" if the Holm-adjusted difference p is below alpha, else "equivalent" if the Holm-adjusted TOST p
    is, else "inconclusive" (Lakens 2017: absence of evidence is not evidence of absence)."""
    if np.isfinite(p_holm) and p_holm < alpha:
        return DIFFERENCE
    if np.isfinite(p_tost_holm) and p_tost_holm < alpha:
        return EQUIVALENT
    return INCONCLUSIVE


# ---------------------------------------------------------------- sign-flip permutation tests


def _flips(n: int, seed: int) -> tuple[np.ndarray, bool]:
    """(F, n) sign matrix: every sign vector when 2^n <= EXACT_FLIPS (exact), else the identity plus
    FLIP_RESAMPLES random ones from ``seed``."""
    if 2**n <= EXACT_FLIPS:
        return np.array(list(itertools.product((1.0, -1.0), repeat=n))), True
    rng = np.random.default_rng(seed)
    return np.vstack([np.ones(n), rng.choice([1.0, -1.0], size=(FLIP_RESAMPLES, n))]), False


def signflip_p(d, *, alternative: str = "two-sided", shift: float = 0.0, seed: int = 0) -> float:
    """Sign-flip permutation p-value for the mean of ``d`` (1-d) against -``shift``: flips the signs of
    d_i + shift. ``alternative``: "two-sided" (|mean|), "less" (mean < -shift) or "greater"."""
    x = np.asarray(d, dtype=float) + shift
    x = x[np.isfinite(x)]
    if len(x) < 1:
        return math.nan
    signs, _ = _flips(len(x), seed)
    perm, obs = (signs * x).mean(axis=1), x.mean()
    tol = 1e-12 * max(1.0, abs(obs))
    if alternative == "two-sided":
        return float(np.mean(np.abs(perm) >= abs(obs) - tol))
    if alternative == "less":
        return float(np.mean(perm <= obs + tol))
    return float(np.mean(perm >= obs - tol))


def signflip_floor(n: int, two_sided: bool = True) -> float:
    """The smallest p-value an exact sign-flip test on n instances can give: 2/2^n two-sided, 1/2^n one-sided."""
    return (2.0 if two_sided else 1.0) / 2**n


def signflip_vector_test(contrasts, seed: int = 0) -> tuple[float, float, bool]:
    """Studentized sign-flip test of H0: E[c] = 0 for per-instance contrast vectors ``contrasts`` (n, k): each
    instance's whole vector is flipped; statistic sum_j t_j^2 (t_j the one-sample t of component j). Returns
    (statistic, p, exact). All-zero components are dropped; NaN when fewer than 2 instances or no component."""
    c = np.asarray(contrasts, dtype=float)
    c = c[np.isfinite(c).all(axis=1)]
    c = c[:, ~np.all(c == 0, axis=0)] if c.size else c
    n = len(c)
    if n < 2 or c.shape[1] == 0:
        return math.nan, math.nan, False
    signs, exact = _flips(n, seed)
    means = signs @ c / n  # (F, k)
    ss = (c**2).sum(axis=0)  # sum of squares is invariant to sign flips
    with np.errstate(divide="ignore", invalid="ignore"):
        var = np.maximum(ss - n * means**2, 0.0) / (n - 1)
        stat = (means**2 / (var / n)).sum(axis=1)
    obs = stat[0]  # the first sign vector is the identity in both branches of _flips
    p = float(np.mean(stat >= obs * (1 - 1e-12)))
    return float(obs), p, exact


# ---------------------------------------------------------------- power and instances needed


def power_difference(n, diff: float, sd: float, alpha: float) -> np.ndarray:
    """Power of the two-sided paired t-test at ``alpha`` with n instances when the true mean difference is ``diff``
    and the SD of the differences ``sd`` (noncentral t, both tails; equals statsmodels TTestPower)."""
    n = np.asarray(n, dtype=float)
    df, ncp = n - 1, diff * np.sqrt(n) / sd
    tc = stats.t.ppf(1 - alpha / 2, df)
    return stats.nct.sf(tc, df, ncp) + stats.nct.cdf(-tc, df, ncp)


def power_tost(n, diff: float, sd: float, margin: float, alpha: float) -> np.ndarray:
    """Lower bound on the power of TOST at ``alpha`` (margin ``margin``) with n instances, true difference ``diff``,
    SD ``sd``: P(T1 > t_c) + P(T2 < -t_c) - 1 with T1, T2 noncentral t (Phillips 1990), clipped at 0."""
    n = np.asarray(n, dtype=float)
    df = n - 1
    tc = stats.t.ppf(1 - alpha, df)
    p1 = stats.nct.sf(tc, df, (diff + margin) * np.sqrt(n) / sd)
    p2 = stats.nct.cdf(-tc, df, (diff - margin) * np.sqrt(n) / sd)
    return np.clip(p1 + p2 - 1, 0.0, 1.0)


_NS = np.arange(2, MAX_INSTANCES + 1)


def instances_needed_difference(diff: float, sd: float, *, alpha: float, power: float) -> float:
    """Smallest n (2..MAX_INSTANCES) at which a paired t-test at ``alpha`` detects a true difference equal to the
    observed ``diff`` with the given power, taking the observed ``sd`` as the truth; inf when out of reach (including
    a zero observed difference), NaN when the SD is unknown."""
    if not (np.isfinite(diff) and np.isfinite(sd)):
        return math.nan
    if diff == 0:
        return math.inf
    if sd == 0:
        return 2.0
    ok = power_difference(_NS, abs(diff), sd, alpha) >= power
    return float(_NS[np.argmax(ok)]) if ok.any() else math.inf


def instances_needed_equivalence(diff: float, sd: float, margin: float, *, alpha: float, power: float) -> float:
    """Smallest n at which TOST at ``alpha`` shows equivalence within ``margin`` with the given power when the true
    difference is the observed ``diff`` (SD the observed ``sd``); inf when out of reach: the observed difference is
    at or beyond the margin (more instances would only confirm it), or more than MAX_INSTANCES are needed."""
    if not (np.isfinite(diff) and np.isfinite(sd)):
        return math.nan
    if abs(diff) >= margin:
        return math.inf
    if sd == 0:
        return 2.0
    ok = power_tost(_NS, abs(diff), sd, margin, alpha) >= power
    return float(_NS[np.argmax(ok)]) if ok.any() else math.inf


# ---------------------------------------------------------------- proportions and cells


def clopper_pearson(k: int, n: int, level: float) -> tuple[float, float]:
    """Exact (Clopper-Pearson) two-sided CI of a binomial proportion k/n at confidence ``level``."""
    if n == 0:
        return math.nan, math.nan
    c = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="exact")
    return float(c.low), float(c.high)


def _split_ratio(x: np.ndarray) -> np.ndarray:
    """Engelman-Hartigan statistic of each row of ``x`` (R, n): max over splits of the sorted values into a lower
    and an upper group of between-group SS / total SS (1-d two-means, optimal over contiguous splits)."""
    x = np.sort(x, axis=-1)
    n = x.shape[-1]
    k = np.arange(1, n)
    csum = np.cumsum(x, axis=-1)[..., :-1]  # sums of the lower groups
    total = x.sum(axis=-1, keepdims=True)
    mean = total / n
    between = k * (csum / k - mean) ** 2 + (n - k) * ((total - csum) / (n - k) - mean) ** 2
    tss = ((x - mean) ** 2).sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return between.max(axis=-1) / tss


@functools.cache
def _bimodality_null(n: int) -> np.ndarray:
    """Sorted Monte Carlo draws of the split statistic for n standard normal values (location-scale invariant)."""
    rng = np.random.default_rng(20240611 + n)
    return np.sort(_split_ratio(rng.standard_normal((NULL_DRAWS, n))))


def bimodality_p(values) -> float:
    """Engelman-Hartigan test that a cell's values form two separated groups (or an outlier) rather than one normal
    sample: Monte Carlo p-value of the split statistic. NaN for fewer than 4 values or no spread."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 4 or np.ptp(x) == 0:
        return math.nan
    obs = float(_split_ratio(x[None, :])[0])
    null = _bimodality_null(len(x))
    exceed = len(null) - np.searchsorted(null, obs * (1 - 1e-12), side="left")
    return float((1 + exceed) / (1 + len(null)))
