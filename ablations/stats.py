"""The statistics protocol for few-seed comparisons of KL variants (fixed in params.yaml ``analysis``).

The seed is the unit of analysis. Each comparison is one arm against the reference arm on one number per seed:

* paired t-test on the per-seed differences when both sides have the same seeds, Welch's t-test otherwise
  (scipy.stats.ttest_rel / ttest_ind(equal_var=False)), with a CI on the raw difference of means;
* an effect size: Cohen's d_z (paired) or Hedges' g (unpaired);
* an exact permutation test as a cross-check (scipy.stats.permutation_test: sign flips when paired, relabelling
  when not; exact whenever the number of rearrangements is small);
* an equivalence test against the pre-registered margin, TOST (statsmodels ttost_paired / ttost_ind);
* Holm correction within a family, separately for the difference and the equivalence p-values
  (statsmodels multipletests(method="holm"); its default method is Holm-Sidak, so the method is always named);
* a verdict: "difference", "equivalent" or "inconclusive", the last with the number of seeds per arm a t-test
  would need to detect an effect the size of the margin (statsmodels TTestPower / tt_ind_solve_power).

Also the KL-budget helpers: gold at the first crossing of a KL budget along an eval trajectory, and the
normalised area under a run's gold-vs-KL budget curve.

Sources: Colas et al. 2018 "How Many Random Seeds?" (arXiv 1806.08295); Colas et al. 2019 "A Hitchhiker's Guide to
Statistical Comparisons of RL Algorithms" (arXiv 1904.06979); Agarwal et al. 2021 "Deep RL at the Edge of the
Statistical Precipice" (arXiv 2108.13264); Lakens 2017 "Equivalence Tests" (Soc. Psychol. Personal. Sci. 8(4));
Lakens 2013 "Calculating and reporting effect sizes" (Front. Psychol. 4:863); Holm 1979 (Scand. J. Stat. 6(2)).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd
from scipy import special, stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower, tt_ind_solve_power
from statsmodels.stats.weightstats import ttost_ind, ttost_paired
from statsmodels.tools.sm_exceptions import ConvergenceWarning

DIFFERENCE, EQUIVALENT, INCONCLUSIVE = "difference", "equivalent", "inconclusive"
MAX_SEEDS = 1000  # cap of the "about N seeds would settle it" recommendation
EXACT_PERMUTATIONS = 2**16  # enumerate every rearrangement up to this many, else sample PERMUTATION_RESAMPLES
PERMUTATION_RESAMPLES = 9999


@dataclass(frozen=True)
class Comparison:
    """One arm against the reference on one number per seed. Filled by compare(), then decided by decide().

    ``diff`` = mean(arm) - mean(reference) (paired: mean of the per-seed differences); ``ci_lo``/``ci_hi`` its
    unadjusted two-sided (1 - alpha) CI; ``sd`` the SD of the paired differences (paired) or the pooled SD
    (Welch); ``effect`` Cohen's d_z (paired) or Hedges' g (unpaired); ``p`` the t-test p-value, ``p_perm``
    the permutation-test p-value, ``p_equiv`` the TOST p-value; the ``*_holm`` fields are the Holm-adjusted
    values within the family; ``within_margin`` says the (adjusted) TOST rejects |diff| >= margin, which can hold
    alongside a detected difference (real but negligible); ``seeds_needed`` is set for inconclusive ones only.
    """

    family: str
    label: str
    arm: str
    reference: str
    level: float | None  # the coefficient or KL budget of the comparison; None for a per-arm summary
    n_arm: int
    n_ref: int
    paired: bool
    mean_arm: float
    mean_ref: float
    diff: float
    ci_lo: float
    ci_hi: float
    sd: float
    effect: float
    effect_name: str
    t: float
    df: float
    p: float
    p_perm: float
    p_equiv: float
    margin: float
    alpha: float
    p_holm: float = math.nan
    p_equiv_holm: float = math.nan
    verdict: str = INCONCLUSIVE
    within_margin: bool = False
    seeds_needed: float = math.nan
    text: str = ""

    def row(self) -> dict:
        """The comparison as a flat dict (one row of comparisons.csv)."""
        return asdict(self)


def _as_series(x) -> pd.Series:
    """Values keyed by seed. A Mapping or Series keeps its keys; a plain sequence is keyed by position."""
    if isinstance(x, pd.Series):
        s = x.astype(float)
    elif isinstance(x, Mapping):
        s = pd.Series({k: float(v) for k, v in x.items()}, dtype=float)
    else:
        s = pd.Series(np.asarray(x, dtype=float))
    return s[np.isfinite(s.to_numpy())]


def hedges_g(a: np.ndarray, b: np.ndarray) -> float:
    """Hedges' g for two independent samples: Cohen's d with the pooled SD, times the small-sample correction
    J = Gamma(df/2) / (sqrt(df/2) Gamma((df-1)/2)), df = n_a + n_b - 2 (Hedges & Olkin 1985, eq. 5.4.7; Lakens 2013
    eq. 4). Written by hand: neither scipy nor statsmodels exposes it for two raw samples."""
    na, nb = len(a), len(b)
    df = na + nb - 2
    if df < 1:
        return math.nan
    pooled = math.sqrt(((na - 1) * np.var(a, ddof=1) + (nb - 1) * np.var(b, ddof=1)) / df)
    d = (np.mean(a) - np.mean(b)) / pooled if pooled > 0 else math.nan
    j = math.exp(special.gammaln(df / 2) - special.gammaln((df - 1) / 2)) / math.sqrt(df / 2) if df > 1 else math.nan
    return d * j


def _mean_stat(x, axis):
    """Mean along ``axis``: the paired sign-flip statistic (vectorised for scipy.stats.permutation_test)."""
    return np.mean(x, axis=axis)


def _diff_of_means(x, y, axis):
    """mean(x) - mean(y) along ``axis``: the unpaired relabelling statistic (vectorised)."""
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def permutation_p(a: np.ndarray, b: np.ndarray, paired: bool, seed: int = 0) -> float:
    """Two-sided permutation p-value for mean(a) - mean(b) (scipy.stats.permutation_test).

    Paired: the per-seed differences with their signs flipped independently (one-sample ``permutation_type=
    "samples"``); 2^n rearrangements. Unpaired: the pooled values relabelled (``"independent"``); C(n_a+n_b, n_a)
    rearrangements. Exact (every rearrangement) when that count is at most EXACT_PERMUTATIONS, else
    PERMUTATION_RESAMPLES random ones from a fixed seed. Note the floor of an exact test: with n paired seeds the
    smallest two-sided p is 2 / 2^n (0.0625 at n = 5).
    """
    if paired:
        count = 2 ** len(a)
        data, stat, kind = (a - b,), _mean_stat, "samples"
    else:
        count = special.comb(len(a) + len(b), len(a), exact=True)
        data, stat, kind = (a, b), _diff_of_means, "independent"
    n_resamples = np.inf if count <= EXACT_PERMUTATIONS else PERMUTATION_RESAMPLES
    res = stats.permutation_test(
        data,
        stat,
        permutation_type=kind,
        n_resamples=n_resamples,
        vectorized=True,
        alternative="two-sided",
        rng=np.random.default_rng(seed),
    )
    return float(res.pvalue)


def compare(
    arm,
    ref,
    *,
    margin: float,
    alpha: float = 0.05,
    family: str = "",
    label: str = "",
    arm_name: str = "",
    ref_name: str = "",
    level: float | None = None,
    permutation: bool = True,
) -> Comparison:
    """Compares one number per seed of an arm with the reference arm (raw p-values; see decide() for verdicts).

    ``arm`` and ``ref`` map seed -> value (pd.Series, dict, or a sequence keyed by position); NaNs are dropped.
    If both sides then hold the same seeds (at least 2), the test is paired: scipy.stats.ttest_rel with its CI,
    Cohen's d_z = mean(d) / sd(d) (Lakens 2013 eq. 6), statsmodels ttost_paired. Otherwise Welch:
    scipy.stats.ttest_ind(equal_var=False) with its Welch-Satterthwaite CI, Hedges' g, statsmodels
    ttost_ind(usevar="unequal"). TOST tests H0: |diff| >= margin. Too few values give NaN statistics.
    """
    a_s, r_s = _as_series(arm), _as_series(ref)
    paired = set(a_s.index) == set(r_s.index) and len(a_s) >= 2
    if paired:
        r_s = r_s.loc[a_s.index]
    a, r = a_s.to_numpy(), r_s.to_numpy()
    nan = math.nan
    base = dict(
        family=family,
        label=label,
        arm=arm_name,
        reference=ref_name,
        level=level,
        n_arm=len(a),
        n_ref=len(r),
        paired=paired,
        mean_arm=float(np.mean(a)) if len(a) else nan,
        mean_ref=float(np.mean(r)) if len(r) else nan,
        margin=margin,
        alpha=alpha,
    )
    if paired:
        d = a - r
        sd = float(np.std(d, ddof=1))
        res = stats.ttest_rel(a, r)
        ci = res.confidence_interval(1 - alpha)
        p_equiv = float(ttost_paired(a, r, -margin, margin)[0]) if sd > 0 else nan
        effect, effect_name = (float(np.mean(d)) / sd if sd > 0 else nan), "d_z"
    elif len(a) >= 2 and len(r) >= 2:
        df_pool = len(a) + len(r) - 2
        sd = math.sqrt(((len(a) - 1) * np.var(a, ddof=1) + (len(r) - 1) * np.var(r, ddof=1)) / df_pool)
        res = stats.ttest_ind(a, r, equal_var=False)
        ci = res.confidence_interval(1 - alpha)
        p_equiv = float(ttost_ind(a, r, -margin, margin, usevar="unequal")[0]) if sd > 0 else nan
        effect, effect_name = hedges_g(a, r), "g"
    else:
        return Comparison(
            **base,
            diff=base["mean_arm"] - base["mean_ref"],
            ci_lo=nan,
            ci_hi=nan,
            sd=nan,
            effect=nan,
            effect_name="d_z" if paired else "g",
            t=nan,
            df=nan,
            p=nan,
            p_perm=nan,
            p_equiv=nan,
        )
    p_perm = permutation_p(a, r, paired) if permutation else nan
    return Comparison(
        **base,
        diff=float(np.mean(a) - np.mean(r)),
        ci_lo=float(ci.low),
        ci_hi=float(ci.high),
        sd=sd,
        effect=effect,
        effect_name=effect_name,
        t=float(res.statistic),
        df=float(res.df),
        p=float(res.pvalue),
        p_perm=p_perm,
        p_equiv=p_equiv,
    )


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm (1979) step-down adjusted p-values (statsmodels multipletests(method="holm")). NaN entries are left
    out of the family and stay NaN."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = multipletests(p[ok], method="holm")[1]
    return out


def seeds_needed(sd: float, margin: float, *, alpha: float, power: float, paired: bool) -> float:
    """Seeds per arm for a two-sided t-test at ``alpha`` to detect a true difference equal to the margin with the
    given power, taking the observed SD (of the paired differences, or pooled) as the truth: statsmodels
    TTestPower().solve_power (paired: a one-sample test on the differences) or tt_ind_solve_power (equal groups).
    Rounded up, at least 2, capped at MAX_SEEDS (returns inf above the cap; NaN if the SD is unknown)."""
    if not (np.isfinite(sd) and sd >= 0):
        return math.nan
    if sd == 0:
        return 2.0
    es = margin / sd
    try:
        solver = TTestPower().solve_power if paired else tt_ind_solve_power
        with warnings.catch_warnings():  # non-convergence is handled below
            warnings.simplefilter("ignore", ConvergenceWarning)
            n = float(np.squeeze(solver(effect_size=es, alpha=alpha, power=power, alternative="two-sided")))
    except Exception:  # the root finder fails for effect sizes far outside its bracket
        n = math.nan
    if not np.isfinite(n):
        # the solver fails at the extremes (n below 2, or far above the cap): the normal approximation settles it
        z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
        n = (z / es) ** 2 * (1 if paired else 2)
    n = float(max(2, math.ceil(n)))
    return math.inf if n > MAX_SEEDS else n


def verdict(p_diff: float, p_equiv: float, alpha: float) -> str:
    """ "difference" if the (adjusted) difference p-value is below alpha, else "equivalent" if the (adjusted)
    TOST p-value is, else "inconclusive" (Lakens 2017: absence of evidence is not evidence of absence)."""
    if np.isfinite(p_diff) and p_diff < alpha:
        return DIFFERENCE
    if np.isfinite(p_equiv) and p_equiv < alpha:
        return EQUIVALENT
    return INCONCLUSIVE


def _fmt_seeds(n: float) -> str:
    """A seed recommendation in words ("about N", or "more than MAX_SEEDS")."""
    return f"more than {MAX_SEEDS}" if n == math.inf else f"about {int(n)}"


def decide(family: Sequence[Comparison], *, power: float, adjust: bool = True, plan: bool = True) -> list[Comparison]:
    """Holm-adjusts a family of comparisons (difference and equivalence p-values separately) and gives each its
    verdict (verdict()) and a sentence. An inconclusive comparison gets ``seeds_needed`` = max(seeds_needed(),
    n + 1): the seeds it has did not settle it, so the recommendation is never below n + 1. ``adjust=False`` uses
    the raw p-values (a family of one); ``plan=False`` skips the power analysis (for fast simulations)."""
    p_h = holm([c.p for c in family]) if adjust else np.array([c.p for c in family])
    e_h = holm([c.p_equiv for c in family]) if adjust else np.array([c.p_equiv for c in family])
    out = []
    for c, ph, eh in zip(family, p_h, e_h):
        v = verdict(ph, eh, c.alpha)
        within = bool(np.isfinite(eh) and eh < c.alpha)
        need = math.nan
        level = f"{100 * (1 - c.alpha):.0f}%"
        if v == DIFFERENCE:
            text = (
                f"difference detected ({c.diff:+.3f}, {level} CI [{c.ci_lo:+.3f}, {c.ci_hi:+.3f}], "
                f"{c.effect_name} = {c.effect:+.2f})"
            )
            if eh < c.alpha:
                text += f"; smaller than the ±{c.margin:g} margin (equivalent too: real but negligible)"
        elif v == EQUIVALENT:
            text = f"equivalent within ±{c.margin:g} ({c.diff:+.3f}, {level} CI [{c.ci_lo:+.3f}, {c.ci_hi:+.3f}])"
        else:
            n_have = min(c.n_arm, c.n_ref)
            if plan:
                need = seeds_needed(c.sd, c.margin, alpha=c.alpha, power=power, paired=c.paired)
                if np.isfinite(need) or need == math.inf:
                    need = max(need, n_have + 1.0)
            if np.isnan(c.p):
                text = f"inconclusive: too few runs to test (n = {c.n_arm} vs {c.n_ref})"
            elif np.isfinite(need) or need == math.inf:
                text = f"inconclusive: {_fmt_seeds(need)} seeds per arm would settle it"
            else:
                text = "inconclusive"
        out.append(
            replace(
                c,
                p_holm=float(ph),
                p_equiv_holm=float(eh),
                verdict=v,
                within_margin=within,
                seeds_needed=need,
                text=text,
            )
        )
    return out


# ---------------------------------------------------------------- KL budgets


def _trajectory(kl: Sequence[float], gold: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """An eval trajectory as float arrays in training order, rows with a non-finite KL or gold dropped."""
    k, g = np.asarray(kl, dtype=float), np.asarray(gold, dtype=float)
    if k.shape != g.shape or k.ndim != 1 or len(k) == 0:
        raise ValueError("kl and gold must be 1-d sequences of the same non-zero length")
    ok = np.isfinite(k) & np.isfinite(g)
    return k[ok], g[ok]


def _first_crossing_line(k: np.ndarray, g: np.ndarray, budget: float) -> float:
    """Gold at KL ``budget`` on the segment ending at the first eval with KL >= budget (numpy.interp);
    the first eval's gold if it is already past the budget. The caller checks that some eval reaches it."""
    i = int(np.argmax(k >= budget))  # first eval at or past the budget (caller checks it exists)
    if i == 0:
        return float(g[0])
    return float(np.interp(budget, k[i - 1 : i + 1], g[i - 1 : i + 1]))


def gold_at_kl(kl: Sequence[float], gold: Sequence[float], budget: float) -> float:
    """Gold reward of a run at a KL budget: linear interpolation (numpy.interp) between the two evals around the
    FIRST time the run's KL reaches the budget, in training order. Later excursions are ignored (KL is not
    monotone), and no checkpoint is chosen by its gold. NaN if the run never reaches the budget."""
    k, g = _trajectory(kl, gold)
    if not len(k) or not (k >= budget).any():
        return math.nan
    return _first_crossing_line(k, g, budget)


def budget_curve_auc(kl: Sequence[float], gold: Sequence[float], max_budget: float) -> float:
    """Normalised area under a run's gold-vs-KL-budget curve, (1 / K) * integral_0^K G(kappa) dkappa with
    K = ``max_budget``, in gold units (the run's mean gold over budgets in [0, K]).

    G(kappa) is gold_at_kl(kappa) -- gold where the run first reaches KL kappa -- while the run reaches kappa, and the
    run's final gold beyond the largest KL it ever reached (stopped by the end of training rather than by the
    budget). Uses the whole trajectory in training order and never a max over checkpoints. G is linear in kappa
    between consecutive eval KL values, so the integral is exact: midpoint rule on each piece, summed with
    the final gold times the width of the tail.
    """
    k, g = _trajectory(kl, gold)
    if not len(k):
        return math.nan
    reach = min(float(k.max()), max_budget)
    cuts = np.unique(np.concatenate([[0.0, reach], k[(k > 0) & (k < reach)]]))
    area = 0.0
    for lo, hi in itertools.pairwise(cuts):  # on (lo, hi] one segment of the trajectory defines G
        area += (hi - lo) * _first_crossing_line(k, g, (lo + hi) / 2)
    if reach < max_budget:
        area += (max_budget - reach) * g[-1]  # constant tail: the final gold
    return area / max_budget
