"""The confirmatory part of the analysis: one pre-registered primary comparison per question, decided by exact
sequential tests, and the headline they carry, with its family-wise error.

Each question q of ``analysis.primary`` names arm - other, each at a calibrated role (ablations/grid.py role_value:
``coef`` the reference arm's best coefficient, ``tuned`` each arm's own best, ``target`` steered to the calibrated
KL target), on final gold or on log final exact KL (Q1: restraint; its margin is ``min_log_kl_reduction``).
Per evaluation instance, in the pre-registered order of ``<task>.instances``, the difference d_i (instances average
their PPO seeds first) feeds ablations/sequential.py: looks after every batch, exact sign-flip CIs at the level
the look spends, four outcomes (material difference, difference, equivalent, inconclusive), and the question is
settled at the first look that shows a material difference or an equivalence.

Error control over the whole headline. K questions share alpha: each gets alpha/K (Bonferroni), spent over its
looks by a union bound (sequential.Schedule). Within a question at most one of its two nulls -- no difference
(Δ = 0) and non-equivalence (|Δ| >= margin) -- is true, so testing both at alpha/K adds nothing; the probability
that any verdict of any question is false is at most K · alpha/K = alpha, whatever the stopping.

Controls. Every question carries the margin-sized positive control (the reference arm at ``coef`` minus at
``control_coef``, whose calibration effect is about one margin), tested at the same look and level, one-sided in
its calibrated direction: a question whose control is not detected cannot say "equivalent" there
(sequential.effective_verdict: "insensitive"). The no-KL control (no KL minus the reference arm at ``coef``) is
reported with its direction checked against calibration; it licenses nothing at the margin.

Beside the exact results, the paired t-test at the decided look (same level) is shown, never used to decide; so
are rliable's interval estimates (Agarwal et al. 2021, "Deep RL at the edge of the statistical precipice"):
percentile-bootstrap 95% CIs of the mean and IQM difference and the probability of improvement P(arm > other),
with its CI (``beside_rliable``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats

from ablations import sequential as Q
from ablations.config import AnalysisParams
from ablations.grid import BASELINE, role_value

MATTERS, NO_MATTER, NOT_SETTLED = "matters", "does not matter", "not settled"
COLUMN = {"gold": "final_gold", "log_kl": "log_kl"}


def schedule(proto: AnalysisParams) -> Q.Schedule:
    """The look schedule of every primary question: alpha/K each, K = number of primary questions."""
    s = proto.sequential
    return Q.Schedule(batch_size=s.batch_size, cap=s.cap, alpha=proto.alpha / len(proto.primary), rho=s.rho)


def cell_of(protocol: dict, arm: str, role: str, reference: str) -> tuple[str, float]:
    """(kind, level) of the runs of ``arm`` at ``role``: a coefficient (kind fixed) or the KL target (matched).
    The reference arm's tuned coefficient is ``coef`` by definition."""
    if role == "tuned" and arm == reference:
        role = "coef"
    return ("matched" if role == "target" else "fixed"), role_value(protocol, arm, role)


def values(runs: pd.DataFrame, arm: str, kind: str, level: float | None, column: str) -> pd.Series:
    """Per instance, the mean over its PPO seeds of ``column`` for ``arm``'s runs of ``kind`` at ``level``."""
    sel = runs[(runs.arm == arm) & (runs.kind == kind)]
    if level is not None:
        sel = sel[np.isclose(sel.level.astype(float), level)]
    return sel.groupby("instance")[column].mean()


def ordered_difference(a: pd.Series, b: pd.Series, order: list[int]) -> np.ndarray:
    """a_i - b_i in the pre-registered instance ``order``; ValueError naming an instance that lacks either."""
    missing = [i for i in order if i not in a.index or i not in b.index]
    if missing:
        raise ValueError(f"instances {missing} lack a run of the comparison")
    return np.array([a[i] - b[i] for i in order], dtype=float)


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


def ordered(a: pd.Series, order: list[int]) -> np.ndarray:
    return np.array([a[i] for i in order], dtype=float)


def question(runs, q: str, spec, protocol: dict, proto: AnalysisParams, order: list[int], margin: float) -> dict:
    """One primary question: its path of looks and its decision, with controls and the t-test beside."""
    ref, column = proto.reference_arm, COLUMN[spec.metric]
    (ka, la), (kb, lb) = (cell_of(protocol, x, spec.role, ref) for x in (spec.arm, spec.other))
    va, vb = values(runs, spec.arm, ka, la, column), values(runs, spec.other, kb, lb, column)
    d = ordered_difference(va, vb, order)
    control = ordered_difference(
        values(runs, ref, "fixed", protocol["coef"], column),
        values(runs, ref, "fixed", protocol["control_coef"], column),
        order,
    )
    direction = int(protocol["control_direction"][spec.metric])
    if direction == 0:  # calibration saw no control effect at all: no look can detect it, so none says equivalent
        control, direction = np.zeros_like(control), 1
    sch = schedule(proto)
    n = (len(d) // sch.batch_size) * sch.batch_size  # complete batches only
    looks = Q.path(d[:n], margin, sch, control=control[:n], control_direction=direction)
    dec = Q.decide(looks)
    k = max(dec["j"], 1) - 1
    at = looks[k] if looks else {}
    none = values(runs, BASELINE, "baseline", None, column)
    nk = ordered_difference(none, values(runs, ref, "fixed", protocol["coef"], column), order)[:n] if n else []
    nk_dir = int(protocol.get("no_kl_direction", {}).get(spec.metric, 0))
    return {
        "question": q,
        "comparison": f"{spec.arm} − {spec.other}",
        "role": spec.role,
        "metric": spec.metric,
        "levels": f"{_where(ka, la)} / {_where(kb, lb)}",
        "margin": margin,
        "verdict": dec["verdict"],
        "status": dec["status"],
        "settled": dec["settled"],
        "n": dec["n"],
        "n_available": len(d),
        "looks": dec["looks"],
        "looks_decided": dec["j"],
        "a_j": dec.get("a_j"),
        "estimate": dec.get("estimate"),
        "lo": dec.get("lo"),
        "hi": dec.get("hi"),
        "lo90": dec.get("lo90"),
        "hi90": dec.get("hi90"),
        "p_exact": Q.signflip_p_one_sided(d[: dec["n"]], 0.0, "two-sided") if dec["n"] else math.nan,
        "control_effect": float(np.mean(control[: dec["n"]])) if dec["n"] else math.nan,
        "control_calibrated": float(protocol["control_effect"][spec.metric]),
        "control_direction": direction,
        "control_detected": at.get("control_detected"),
        "no_kl_effect": float(np.mean(nk)) if len(nk) else math.nan,
        "no_kl_expected_sign": nk_dir,
        "no_kl_direction_ok": bool(len(nk) and nk_dir and np.sign(np.mean(nk)) == nk_dir),
        **(_t_beside(d[: dec["n"]], dec["a_j"]) if dec["n"] else _t_beside(np.array([]), 0.05)),
        **beside_rliable(ordered(va, order[: dec["n"]]), ordered(vb, order[: dec["n"]])),
        "path": [_look(x) for x in looks],
        "differences": {int(i): float(x) for i, x in zip(order, d)},  # per instance, pre-registered order
    }


def _where(kind: str, level: float) -> str:
    return f"KL target {level:.3g}" if kind == "matched" else f"β {level:g}"


def _look(look: dict) -> dict:
    keep = ("j", "n", "a_j", "reachable", "estimate", "lo", "hi", "lo90", "hi90", "verdict", "control_detected")
    return {k: look[k] for k in keep} | {"effective": Q.effective_verdict(look)}


def headline(rows: list[dict]) -> str:
    """ "matters" when some primary question settles as a material difference; "does not matter" when every one
    settles as equivalent (each with its margin-sized control detected); else "not settled"."""
    verdicts = [r["verdict"] for r in rows if r["settled"]]
    if Q.MATERIAL in verdicts:
        return MATTERS
    if rows and len(verdicts) == len(rows) and all(v == Q.EQUIVALENT for v in verdicts):
        return NO_MATTER
    return NOT_SETTLED


def analyse(runs: pd.DataFrame, task: str, proto: AnalysisParams, protocol: dict, order: list[int]) -> dict:
    """Every primary question of ``task`` (``runs``: its evaluation runs with ``log_kl``), the headline and the
    error budget."""
    tp = proto.tasks[task]
    margins = {"log_kl": tp.min_log_kl_reduction, **{m: float(v) for m, v in protocol["margins"].items()}}
    rows = [question(runs, q, s, protocol, proto, order, margins[s.metric]) for q, s in proto.primary.items()]
    sch = schedule(proto)
    budget = {
        "alpha": proto.alpha,
        "questions": len(rows),
        "per_question": sch.alpha,
        "looks": [int(x) for x in sch.looks()],
        "levels": [float(x) for x in sch.levels()],
        "reachable": [sch.reachable(j) for j in range(1, sch.J + 1)],
    }
    return {"primary": rows, "headline": headline(rows), "budget": budget}
