"""The three mutations of issue 17 point 10 that no test caught, each named in its test's docstring: deciding TOST on
the 95% instead of the 90% CI, testing the positive control at alpha instead of alpha/m, and computing "instances
needed" at alpha instead of alpha/m (the exploratory families, ablations/questions.py)."""

from __future__ import annotations

import types

import numpy as np
import pandas as pd
from scipy import stats

from ablations import stats as S
from ablations.questions import compare, decide_family, family

ALPHA, POWER = 0.05, 0.8


def _shifted(mean: float, sd_unit: np.ndarray) -> np.ndarray:
    return mean + sd_unit


def _d_with_ci(n: int, half90: float, mean: float = 0.0) -> np.ndarray:
    """n values with the given mean whose 90% t CI has half-width ``half90``."""
    z = np.linspace(-1, 1, n)
    z = (z - z.mean()) / z.std(ddof=1)
    sd = half90 / stats.t.ppf(1 - ALPHA, n - 1) * np.sqrt(n)
    return mean + sd * z


def _row(d: np.ndarray, margin: float) -> dict:
    a = pd.Series(d, index=range(len(d)))
    b = pd.Series(np.zeros(len(d)), index=range(len(d)))
    return {"label": "x", **compare(a, b, margin=margin, alpha=ALPHA, permutation=False)}


def test_tost_is_decided_on_the_90_percent_ci_not_the_95():
    """Mutation caught: deciding TOST on the (1 - alpha) = 95% CI instead of the (1 - 2 alpha) = 90% CI. The data's
    90% CI lies inside +-margin while its 95% CI reaches beyond it: only the 90% rule says equivalent."""
    d = _d_with_ci(8, half90=0.9)
    row = _row(d, margin=1.0)
    assert row["ci90_lo"] > -1.0 and row["ci90_hi"] < 1.0
    assert row["ci95_hi"] > 1.0  # the 95% CI reaches past the margin
    (out,) = decide_family([row], alpha=ALPHA, power=POWER)
    assert out["verdict"] == S.EQUIVALENT


def _family(pc_p_target: float, m: int):
    """A family of m comparisons and a positive control whose paired t p-value is ``pc_p_target``."""
    n = 10
    t = stats.t.isf(pc_p_target / 2, n - 1)
    z = np.linspace(-1, 1, n)
    z = (z - z.mean()) / z.std(ddof=1)
    pc = 1.0 + z * (1.0 / t) * np.sqrt(n)  # mean 1, se 1/t: t statistic exactly t
    idx = range(n)
    series = {"none": pd.Series(pc, index=idx), "ref": pd.Series(np.zeros(n), index=idx)}
    for k in range(m):
        series[f"arm{k}"] = pd.Series(np.linspace(-1, 1, n) * (k + 1), index=idx)
    proto = types.SimpleNamespace(alpha=ALPHA, power=POWER, reference_arm="ref")
    pairs = [(f"arm{k}", "ref", "vs reference") for k in range(m)]
    return family(task="t", question="Q2", metric="gold", level=0.1, name="f", pairs=pairs,
                  values=series.__getitem__, margin=0.5, proto=proto, permutation=False)  # fmt: skip


def test_the_positive_control_is_tested_at_alpha_over_m():
    """Mutation caught: testing the no-KL positive control at alpha instead of alpha/m. With m = 4 comparisons a
    control at p = 0.03 (< alpha, > alpha/4) must not pass; at p = 0.005 (< alpha/4) it must."""
    _, fam = _family(0.03, m=4)
    assert fam["pc_threshold"] == ALPHA / 4 and np.isclose(fam["pc_p"], 0.03)
    assert not fam["pc_pass"]
    _, fam = _family(0.005, m=4)
    assert fam["pc_pass"]


def test_instances_needed_are_computed_at_alpha_over_m():
    """Mutation caught: computing "instances needed" at alpha instead of the Holm level alpha/m. Three inconclusive
    comparisons: the planned n is the one at alpha/3, and it is larger than the n at alpha."""
    rng = np.random.default_rng(0)
    rows = [_row(rng.normal(0.2, 1.0, 6), margin=0.5) for _ in range(3)]
    out = decide_family(rows, alpha=ALPHA, power=POWER)
    for r in out:
        assert r["verdict"] == S.INCONCLUSIVE
        want = S.instances_needed_difference(r["diff"], r["sd"], alpha=ALPHA / 3, power=POWER)
        loose = S.instances_needed_difference(r["diff"], r["sd"], alpha=ALPHA, power=POWER)
        assert r["n_needed_diff"] == want and (want > loose or not np.isfinite(loose))
        want_e = S.instances_needed_equivalence(r["diff"], r["sd"], 0.5, alpha=ALPHA / 3, power=POWER)
        assert r["n_needed_equiv"] == want_e or (np.isinf(want_e) and np.isinf(r["n_needed_equiv"]))
