"""The confirmatory part of the analysis (protocol v4): the pre-registered primary comparisons, decided by exact
sequential sign tests of the median difference, and the headline the placement questions carry.

Each question of ``analysis.primary`` is arm - other at a calibrated role; a ``levels`` question (the gold-KL
frontier) is one comparison per KL level (ablations/comparisons.py builds every comparison's per-instance table).
Per comparison, in the pre-registered order of ``<task>.instances`` (only the instances its cells were allocated),
the differences feed ablations/rule.py: looks after every batch, the exact, distribution-free sign test of the
MEDIAN difference with order-statistic CIs at the level the look spends (ablations/signtest.py; no symmetry is
assumed, so the error bounds hold for the skewed differences the tasks produce), four outcomes in order of
precedence (material difference > equivalent > non-zero, materiality undetermined > inconclusive), and the
comparison is settled at the first look that shows a material difference or an equivalence. An equivalence needs
the margin-sized positive control detected (else "insensitive") and the penalty shown to act: the no-KL contrast
beyond its margin in its calibrated direction (else "inert": placement is not testable there). A frontier comparison
at a level where an arm hits the level in fewer than ``min_hit_rate`` of its runs is "not steerable" there (not
compared). Each comparison runs to its own cap (the sample-size plan, protocol/<task>.plan.json).

Amendment 1 (made at look 9, after results; ablations/lock.py lists it with the verdicts before and after): a
comparison that is not steerable at its last look, and cannot become steerable at any look up to its cap, is closed
(status ``CLOSED``) instead of open, so `make settle` stops its cells. A look's hit rate can rise by at most the runs
still to come, all hits; the best case is the cap (``steerable_in_reach``). The verdict is the one the frozen rule
would give at every look to the cap ("not steerable"): the amendment saves cells, it changes no verdict and spends
no alpha (steerability is not a test).

Error control. K comparisons (levels expanded) share alpha: alpha/K each (Bonferroni), spent over the reachable
looks by a union bound (rule.Schedule). Within a comparison at most one of its nulls is true (no difference, not
material, not equivalent), so the probability that any claim of any comparison of a task is wrong is at most
alpha, whatever the stopping.

Beside the exact results, the paired t-test at the decided look (same level) is shown, never used to decide; so are
rliable's interval estimates (Agarwal et al. 2021): percentile-bootstrap 95% CIs of the mean and IQM difference and
the probability of improvement P(arm > other), with its CI (``beside_rliable``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats

from ablations import rule as R
from ablations import signtest as T
from ablations.comparisons import Comparison, primary_comparisons, table
from ablations.config import AnalysisParams

MATTERS, NO_MATTER, NOT_SETTLED = "matters", "does not matter", "not settled"
NOT_STEERABLE = "not steerable"
CLOSED = "closed: not steerable by its cap"  # amendment 1: no look up to the cap can be steerable


def schedule(proto: AnalysisParams, n_comparisons: int, cap: int) -> R.Schedule:
    """The look schedule of one comparison: alpha/K (K comparisons), to its planned ``cap``."""
    s = proto.sequential
    return R.Schedule(batch_size=s.batch_size, cap=cap, alpha=proto.alpha / n_comparisons)


def _t_beside(d: np.ndarray, a: float) -> dict:
    """The paired t-test of d at level a (two-sided p, (1 - a) CI): shown beside the exact result, never used."""
    n = len(d)
    if n < 2 or not np.isfinite(d).all():
        return {"t_p": math.nan, "t_lo": math.nan, "t_hi": math.nan}
    se = d.std(ddof=1) / math.sqrt(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = float(2 * stats.t.sf(abs(d.mean() / se), n - 1)) if se > 0 else float(d.mean() == 0)
    half = stats.t.ppf(1 - a / 2, n - 1) * se
    return {"t_p": p, "t_lo": float(d.mean() - half), "t_hi": float(d.mean() + half)}


def probability_of_improvement(x, y, axis: int = -1) -> np.ndarray | float:
    """P(X > Y) as rliable defines it (google-research/rliable 1.2.0, rliable/metrics.py
    ``probability_of_improvement``, lines 73-95): the Mann-Whitney U statistic of X over Y divided by n_x n_y, a
    tie counting 1/2 -- the chance that a run of X scores above a run of Y. One task here, so no average over
    tasks. Along ``axis`` (vectorised for the bootstrap)."""
    x, y = np.moveaxis(np.asarray(x, float), axis, -1), np.moveaxis(np.asarray(y, float), axis, -1)
    a, b = x[..., :, None], y[..., None, :]
    p = ((a > b) + 0.5 * (a == b)).mean(axis=(-2, -1))
    return float(p) if np.ndim(p) == 0 else p


def iqm(x, axis: int = -1):
    """Interquartile mean: the 25% trimmed mean (rliable metrics.py ``aggregate_iqm``, scipy.stats.trim_mean)."""
    return stats.trim_mean(x, proportiontocut=0.25, axis=axis)


RLIABLE = {
    "boot_mean": lambda a, b, axis: np.mean(a, axis=axis) - np.mean(b, axis=axis),
    "boot_iqm": lambda a, b, axis: iqm(a, axis=axis) - iqm(b, axis=axis),
    "p_improve": probability_of_improvement,
}


def beside_rliable(a: np.ndarray, b: np.ndarray, level: float = 0.95, resamples: int = 2000) -> dict:
    """rliable's interval estimates of arm (``a``) against other (``b``), per instance in the same order: each
    statistic and its percentile-bootstrap CI (rliable's StratifiedBootstrap with one stratum, the task, over
    instances; paired: an instance's two values are resampled together). Seeded: the report is reproducible.
    Shown beside the exact tests, never used to decide; NaN with fewer than two instances."""
    out = {}
    for name, stat in RLIABLE.items():
        out[name] = float(stat(a, b, axis=-1)) if len(a) else math.nan
        lo = hi = math.nan
        if len(a) >= 2 and np.isfinite(a).all() and np.isfinite(b).all():
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # degenerate resamples (all equal) give a NaN bound: shown as –
                ci = stats.bootstrap(
                    (a, b), stat, paired=True, vectorized=True, n_resamples=resamples, confidence_level=level,
                    method="percentile", rng=np.random.default_rng(0),
                ).confidence_interval  # fmt: skip
            lo, hi = float(ci.low), float(ci.high)
        out[f"{name}_lo"], out[f"{name}_hi"] = lo, hi
    return out


def steerable(t: pd.DataFrame, n: int, min_hit_rate: float) -> bool:
    """Whether both sides of a level comparison hit the level in >= ``min_hit_rate`` of the first ``n`` instances
    (always True for a coefficient comparison)."""
    if "hit_arm" not in t:
        return True
    head = t.iloc[:n]
    return bool(head.hit_arm.mean() >= min_hit_rate and head.hit_other.mean() >= min_hit_rate)


def steerable_in_reach(t: pd.DataFrame, n: int, cap: int, min_hit_rate: float) -> bool:
    """Amendment 1: whether some look n' in (n, cap] could still be steerable: with h of the first n runs hits, the
    best case (every later run a hit) has rate (h + n' - n) / n', which rises with n' (its slope is (n - h) / n'^2
    >= 0), so it is reachable iff (h + cap - n) / cap >= ``min_hit_rate`` for both sides. True for a coefficient
    comparison."""
    if "hit_arm" not in t:
        return True
    head = t.iloc[:n]
    best = lambda hits: (int(hits.sum()) + cap - n) / cap
    return bool(best(head.hit_arm) >= min_hit_rate and best(head.hit_other) >= min_hit_rate)


def comparison(t: pd.DataFrame, meta: dict, c: Comparison, proto: AnalysisParams, n_comparisons: int, cap: int) -> dict:
    """One comparison's path of looks and its decision on its per-instance table ``t`` (ablations.comparisons)."""
    sch = schedule(proto, n_comparisons, cap)
    available = len(t)
    n = min((available // sch.batch_size) * sch.batch_size, sch.cap)  # complete batches only, up to the cap
    t = t.iloc[:n]
    d = t.d.to_numpy(float)
    acts = None if t.acts.isna().all() else t.acts.to_numpy(float)
    looks = R.path(
        d, meta["margin"], sch, control=t.control.to_numpy(float), control_direction=meta["control_direction"],
        nokl=acts, nokl_direction=meta.get("acts_direction", 0), nokl_margin=meta.get("acts_margin"),
    ) if n else []  # fmt: skip
    for look in looks:
        look["steerable"] = steerable(t, look["n"], proto.min_hit_rate)
        if not look["steerable"]:
            look["verdict"] = NOT_STEERABLE
    dec = R.decide(looks)
    in_reach = steerable_in_reach(t, n, sch.cap, proto.min_hit_rate) if n else True
    status = CLOSED if dec["status"] == "open" and not in_reach else dec["status"]  # amendment 1
    m = dec["n"]
    at = looks[max(dec["j"], 1) - 1] if looks else {}
    spec = c.spec
    row = {
        "question": c.question,
        "comparison": c.name,
        "kind": spec.kind,
        "contrast": f"{spec.arm} − {spec.other}",
        "role": c.role,
        "metric": spec.metric,
        "level": meta["level"],
        "margin": meta["margin"],
        "cap": cap,
        "verdict": dec["verdict"],
        "label": T.label(dec["verdict"], bool(dec.get("nonzero"))),
        "status": status,
        "status_frozen": dec["status"],  # before amendment 1
        "settled": dec["settled"],
        "n": m,
        "n_available": available,
        "looks": dec["looks"],
        "looks_decided": dec["j"],
        "a_j": dec.get("a_j"),
        "estimate": dec.get("estimate"),
        "lo": dec.get("lo"),
        "hi": dec.get("hi"),
        "lo90": dec.get("lo90"),
        "hi90": dec.get("hi90"),
        "nonzero": dec.get("nonzero"),
        "mean": float(d[:m].mean()) if m else math.nan,
        "p_sign": T.sign_p(d[:m], 0.0, "two-sided") if m else math.nan,
        "control_effect": float(np.median(t.control.to_numpy(float)[:m])) if m else math.nan,
        "control_direction": meta["control_direction"],
        "control_detected": at.get("control_detected"),
        "acts_effect": float(np.median(acts[:m])) if m and acts is not None else math.nan,
        "acts_margin": meta.get("acts_margin"),
        "acts_direction": meta.get("acts_direction"),
        "acts": at.get("acts"),
        "hit_rate_arm": float(t.hit_arm.iloc[:m].mean()) if m and "hit_arm" in t else None,
        "hit_rate_other": float(t.hit_other.iloc[:m].mean()) if m and "hit_other" in t else None,
        "steerable": at.get("steerable", True),
        "steerable_in_reach": in_reach,
        "differences": {int(i): float(x) for i, x in zip(t.index, d)},  # every look's instances; the first n decided
        **(_t_beside(d[:m], dec["a_j"]) if m and dec.get("a_j") else _t_beside(np.array([]), 0.05)),
        **beside_rliable(t.arm.to_numpy(float)[:m], t.other.to_numpy(float)[:m]),
        "path": [_look(x) for x in looks],
    }
    return row


def _look(look: dict) -> dict:
    keep = ("j", "n", "a_j", "reachable", "estimate", "lo", "hi", "lo90", "hi90", "verdict", "nonzero",
            "control_detected", "acts", "steerable")  # fmt: skip
    return {k: look.get(k) for k in keep} | {"effective": R.effective_verdict(look)}


def headline(rows: list[dict]) -> str:
    """ "matters" when some placement comparison settles as a material difference; "does not matter" when every
    placement comparison settles as equivalent (each with its control detected and the penalty shown to act); else
    "not settled". Penalty and practice questions are reported beside it, not in it."""
    place = [r for r in rows if r["kind"] == "placement"]
    verdicts = [r["verdict"] for r in place if r["settled"]]
    if T.MATERIAL in verdicts:
        return MATTERS
    if place and len(verdicts) == len(place) and all(v == T.EQUIVALENT for v in verdicts):
        return NO_MATTER
    return NOT_SETTLED


def carriers(rows: list[dict], headline_: str) -> list[str]:
    """The comparisons that carry the headline: the material placement comparisons (matters), every placement
    comparison (does not matter), none (not settled)."""
    if headline_ == MATTERS:
        return [r["comparison"] for r in rows if r["kind"] == "placement" and r["verdict"] == T.MATERIAL]
    if headline_ == NO_MATTER:
        return [r["comparison"] for r in rows if r["kind"] == "placement"]
    return []


def analyse(
    runs: pd.DataFrame, evals: pd.DataFrame, task: str, proto: AnalysisParams, protocol: dict, plan: dict,
    order: list[int],
) -> dict:  # fmt: skip
    """Every primary comparison of ``task`` (``runs``/``evals``: its evaluation runs), the headline and the error
    budget. ``plan``: protocol/<task>.plan.json (each comparison's cap); ``order``: the evaluation instances."""
    tp = proto.tasks[task]
    comps = primary_comparisons(proto, len(protocol["levels"]))
    rows = []
    for c in comps:
        t, meta = table(runs, evals, c, protocol, proto.reference_arm, tp.kl_tolerance)
        t = t.reindex([i for i in order if i in t.index])
        rows.append(comparison(t, meta, c, proto, len(comps), int(plan["comparisons"][c.name]["cap"])))
    head = headline(rows)
    budget = {
        "alpha": proto.alpha,
        "comparisons": len(rows),
        "per_comparison": proto.alpha / len(rows),
        "caps": {r["comparison"]: r["cap"] for r in rows},
    }
    return {"primary": rows, "headline": head, "carried_by": carriers(rows, head), "budget": budget}
