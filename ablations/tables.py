"""Markdown tables and small phrases of the report (formatting only; every number is computed elsewhere)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from ablations import stats as S
from ablations.config import AnalysisParams
from ablations.diagnostics import is_off
from ablations.experiment import SPEC_FIELDS
from ablations.load import BASELINE


def fmt(x, nd: int = 3, sign: bool = False) -> str:
    """A number with ``nd`` decimals (signed if ``sign``); "–" for None/NaN/inf."""
    if x is None or (isinstance(x, float | np.floating) and not np.isfinite(x)):
        return "–"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def ci(lo, hi, nd: int = 3, sign: bool = True) -> str:
    return f"[{fmt(lo, nd, sign)}, {fmt(hi, nd, sign)}]"


def pval(p: float) -> str:
    return "–" if not np.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def count(n: float) -> str:
    """An instance count: "N", or "out of reach" (inf), or "–"."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "–"
    return f">{S.MAX_INSTANCES} / out of reach" if math.isinf(n) else str(int(n))


def span(x: pd.Series) -> str:
    lo, hi = int(x.min()), int(x.max())
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def md(rows: list[dict] | pd.DataFrame) -> str:
    df = pd.DataFrame(rows)
    return "(none)" if df.empty else df.to_markdown(index=False, disable_numparse=True)


def _cell(arm: str, kind: str, level) -> str:
    if arm == BASELINE:
        return "no KL"
    return f"{arm} @ {'coef' if kind == 'fixed' else 'KL'} {level:g}"


def collapse_words(collapse: pd.DataFrame) -> str:
    """ "collapses: cell k/n (95% CI [..]), ..." for cells with any collapsed run."""
    hit = collapse[collapse.collapsed > 0]
    if hit.empty:
        return "no run collapsed"
    return "collapses: " + ", ".join(
        f"{_cell(r.arm, r.kind, r.level)} {r.collapsed}/{r.runs} (95% CI {ci(r.ci_lo, r.ci_hi, 2, False)})"
        for r in hit.itertuples()
    )


def families_table(f: pd.DataFrame, alpha: float) -> str:
    rows = [
        {"family": r.family, "m": str(r.m), "n": str(r.n),
         "positive control": f"{fmt(r.pc_diff, sign=True)}, p {pval(r.pc_p)} vs α/m {r.pc_threshold:.4f}",
         "passes": "yes" if r.pc_pass else "**no: insensitive**",
         "exact floor": f"{r.floor:.4f}", "exact test can reach α/m": "yes" if r.exact_reachable else "no"}
        for r in f.itertuples()
    ]  # fmt: skip
    return md(rows)


def restraint_table(r: pd.DataFrame) -> str:
    rows = [
        {"coef": f"{x.level:g}", "arm": x.arm, "n": str(x.n), "KL arm / no KL (nats, geo. mean)":
         f"{fmt(x.kl_arm, 2)} / {fmt(x.kl_none, 2)}", "log ratio": fmt(x.log_ratio, sign=True),
         "90% CI": ci(x.ci90_lo, x.ci90_hi), "p restrains (Holm)": pval(x.p_restrain_holm),
         "p does not (Holm)": pval(x.p_no_restraint_holm), "p sign-flip (restrains)": pval(x.p_perm),
         "verdict": x.verdict}
        for x in r.itertuples()
    ]  # fmt: skip
    return md(rows)


def _cell_key(r) -> tuple:
    return (r.kind, r.arm, None if pd.isna(r.level) else float(r.level))


def collapse_table(col: pd.DataFrame, cells: pd.DataFrame) -> str:
    flags = {
        _cell_key(c): (c.bimodality_p, c.bimodal_why, c.final_gold_mean, c.final_gold_sd) for c in cells.itertuples()
    }
    rows = []
    for r in col.itertuples():
        bp, why, m, sd = flags.get(_cell_key(r), (math.nan, "", math.nan, math.nan))
        flag = f"**yes**: {why} (E-H p {pval(bp)})" if why else f"no (E-H p {pval(bp)})"
        rate, gold = f"{r.rate:.2f} {ci(r.ci_lo, r.ci_hi, 2, False)}", f"{fmt(m)} ± {fmt(sd)}"
        row = {"cell": _cell(r.arm, r.kind, r.level), "runs": str(r.runs), "collapsed": str(r.collapsed)}
        rows.append(row | {"rate (95% CI)": rate, "final gold mean ± SD": gold, "bimodal": flag})
    return md(rows)


def steering_table(st: pd.DataFrame) -> str:
    rows = [
        {"arm": r.arm, "target (nats)": f"{r.target:g}", "hits": f"{r.hits}/{r.runs}",
         "hit rate (95% CI)": f"{r.rate:.2f} {ci(r.ci_lo, r.ci_hi, 2, False)}",
         "steerable": "yes" if r.steerable else "**no**",
         "final KL median [min, max]": f"{fmt(r.kl_median, 2)} [{fmt(r.kl_min, 2)}, {fmt(r.kl_max, 2)}]"}
        for r in st.itertuples()
    ]  # fmt: skip
    return md(rows)


def _verdict(r) -> str:
    if not r.in_family:
        return "detected" if r.verdict == S.DIFFERENCE else "**not detected**"
    if r.verdict == S.DIFFERENCE:
        return "difference (within margin)" if r.within_margin else "**difference**"
    if r.verdict == S.INCONCLUSIVE and r.n >= 2:
        return f"inconclusive (n for Δ: {count(r.n_needed_diff)}; for equivalence: {count(r.n_needed_equiv)})"
    return r.verdict


def comparison_table(c: pd.DataFrame) -> str:
    rows = [
        {"family": r.family.split(" @ ")[-1] if " @ " in r.family else "tuned", "comparison": r.label,
         "role": r.role, "n": str(r.n), "means": f"{fmt(r.mean_arm)} / {fmt(r.mean_other)}",
         "Δ": fmt(r.diff, sign=True), "95% CI": ci(r.ci95_lo, r.ci95_hi), "90% CI (TOST)": ci(r.ci90_lo, r.ci90_hi),
         "p Holm": pval(r.p_holm) if r.in_family else f"{pval(r.p)} (raw)", "p TOST Holm": pval(r.p_tost_holm),
         "p sign-flip": pval(r.p_perm), "verdict": _verdict(r)}
        for r in c.itertuples()
    ]  # fmt: skip
    return md(rows)


def factorial_table(f: pd.DataFrame) -> str:
    rows = [
        {"runs": "tuned" if r.kind == "tuned" else f"{r.kind} {r.level:g}", "effect": r.effect,
         "components": str(r.components), "n": str(r.n), "mean": fmt(r.mean, sign=True),
         "Σt²": f"{r.statistic:.3g}", "p (sign-flip)": pval(r.p) + ("" if r.exact else " (MC)"),
         "floor": f"{r.floor:.4f}", "bimodal cells": r.bimodal_cells or "–"}
        for r in f.itertuples()
    ]  # fmt: skip
    return md(rows)


def secondary_lines(sec: pd.DataFrame, proto: AnalysisParams) -> list[str]:
    """One line per arm and outcome: its value per level and its difference to the reference with a 95% CI."""
    if sec.empty:
        return ["(no length or empty-response measurements)"]
    out = []
    for (arm, outcome), g in sec.groupby(["arm", "outcome"], sort=False):
        unit = "tokens" if outcome == "length" else "share"
        parts = []
        for r in g.itertuples():
            where = "" if r.kind == "baseline" else f"{'coef' if r.kind == 'fixed' else 'KL'} {r.level:g}: "
            d = (
                ""
                if pd.isna(getattr(r, "diff", np.nan))
                else f" (Δ {fmt(r.diff, 2, True)}, 95% CI {ci(r.ci_lo, r.ci_hi, 2)})"
            )
            parts.append(f"{where}{fmt(r.mean, 2)}{d}")
        name = "no KL" if arm == BASELINE else arm
        what = "final length" if outcome == "length" else "empty responses"
        out.append(f"- {name}, {what} ({unit}; Δ vs {proto.reference_arm}): " + "; ".join(parts))
    return out


def scale_words(runs: pd.DataFrame, margin: float, reference: str) -> str:
    """The gold margin against the scales it is meant to be a fraction of, as observed in these runs."""
    base = runs[runs.kind == "baseline"]
    peak = float((base.peak_gold - base.sft_gold).mean()) if "peak_gold" in base else math.nan
    ref = runs[(runs.kind == "fixed") & (runs.arm == reference)]
    gain = (ref.final_gold - ref.sft_gold).groupby(ref.level).mean()
    best = float(gain.max()) if len(gain) else math.nan
    return (
        f"Observed scales (not used to set the margin): the no-KL runs' mean peak gold gain over SFT is {fmt(peak)} "
        f"(gold margin = {_share(margin, peak)} of it); {reference}'s best mean final gain over SFT across "
        f"coefficients is {fmt(best)} (margin = {_share(margin, best)} of it)."
    )


def _share(margin: float, scale: float) -> str:
    return f"{margin / scale:.0%}" if np.isfinite(scale) and scale > 0 else "–"


def target_overlap(targets: list[float], tol: float) -> str:
    """A warning when adjacent KL targets' tolerance bands overlap (a run could hit two targets)."""
    t = sorted(targets)
    bad = [(a, b) for a, b in itertools.pairwise(t) if a * (1 + tol) >= b * (1 - tol)]
    if not bad:
        return ""
    return "**Warning:** the tolerance bands of targets " + ", ".join(f"{a:g} and {b:g}" for a, b in bad) + " overlap."


def methods(tr, p: AnalysisParams) -> list[str]:
    tp = p.tasks[tr.task]
    seq = p.sequential
    return [
        "## Methods (pre-registered in params.yaml `analysis`; margins and coefficients calibrated)",
        "",
        "- Unit: the task instance (its own data, SFT policy and reward); PPO seeds nested in an instance are "
        "averaged first. Arms share instances, so every test is paired by instance.",
        "- Calibration: the margins (gold and log KL), the coefficient where the penalty acts, each arm's best "
        "coefficient, the frontier's KL levels and the margin-sized control (interpolated) were fixed by the "
        "calibration stage on calibration instances disjoint from the evaluation instances "
        "(ablations/calibration.py); each comparison's cap by the planning stage on planning instances, disjoint "
        "too (ablations/plan.py); both before any evaluation cell ran.",
        f"- Primary comparisons: the exact sign test of the median paired difference with order-statistic CIs "
        f"(ablations/signtest.py), evaluation instances added in batches of {seq.batch_size} up to each "
        f"comparison's planned cap (at most {seq.max_cap}), α/K per comparison spent equally over its reachable "
        "looks (ablations/rule.py); per-question allocation: a settled or capped comparison's own cells stop; "
        "t-tests shown beside, never deciding.",
        f"- Exploratory families: paired t-test, two-sided, Holm within each family at α = {p.alpha:g}; 95% CI beside "
        f"it. Equivalence: TOST against the metric's calibrated margin "
        f"({', '.join(f'{k} ±{v:.3g}' for k, v in tp.margins.items())}), Holm within the family; its 90% CI is "
        "printed beside every verdict. Verdict: *difference* (Holm p < α; *within margin* if TOST also passes), "
        "else *equivalent*, else *inconclusive* with the instances a t-test (or TOST) at α/m would need for power "
        f"{p.power:g} when the true difference is the OBSERVED one with the observed SD.",
        "- Families: E1 (restraint) one per coefficient; E2 (matched coefficient) one per (metric, coefficient); E3 "
        "(matched KL) one per (metric, KL level); the coefficients and levels are those the design cells ran at. "
        "Members: each arm against the reference arm and, within each estimator with both, loss against reward "
        "placement. The no-KL positive control (no KL against the reference arm; Q1: the reference arm restrains) "
        "is outside the family and must pass at α/m. (In stats.json and comparisons.csv these families keep their v3 "
        "names Q1-Q3.)",
        "- Exact sign-flip tests are shown as a cross-check; with n instances their floor is 2/2^n (1/2^n one-sided).",
        "- Bimodality: a cell is flagged when it mixes collapsed and non-collapsed runs, or when the "
        f"Engelman–Hartigan two-group test of its final gold over runs gives p < {p.bimodality_alpha:g}. "
        "Factorial effects: studentized sign-flip tests of within-instance contrasts.",
        f"- Protocol values: reference arm {p.reference_arm}; α {p.alpha:g}; power {p.power:g}; log-KL margin "
        f"{tp.margins['log_kl']:.3g}; KL-level tolerance ±{tp.kl_tolerance:.0%}; minimum hit rate "
        f"{p.min_hit_rate:g}; collapse drop {tp.collapse_drop:.3g} (the gold margin); bimodality α "
        f"{p.bimodality_alpha:g}.",
        f"- {scale_words(tr.runs, tp.margins['gold'], p.reference_arm)}",
        "",
    ]


# ---------------------------------------------------------------- gradient diagnostics

# how a spec field (ablations.experiment.SPEC_FIELDS) is labelled where its name reads badly; any other field by its
# name, so a new option needs no entry here
SPEC_LABELS = {
    "group_size": "group",
    "is_weight": "IS weight",
    "return_to_go": "return-to-go",
    "kl_clamp": "KL clamp",
    "ref_sync_every": "ref. sync every",
    "ref_sync_alpha": "ref. sync α",
}
DIAGNOSTIC_COLUMNS = {
    "cosine": "cosine (bias only)",
    "cosine_noise_floor": "its noise floor",
    "cosine_minibatch": "cosine, one minibatch",
    "scale": "scale",
    "rel_bias": "rel. bias",
    "rel_bias_excess": "rel. bias beyond noise",
    "rel_var": "rel. variance (one minibatch)",
}


def g3(x) -> str:
    """Three significant digits (no exponent below 1000); "–" for None/NaN/inf."""
    if x is None or not np.isfinite(x):
        return "–"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:#.3g}".rstrip(".")


def spec_label(field: str) -> str:
    return SPEC_LABELS.get(field, field.replace("_", " "))


def _spec_value(field: str, v) -> str:
    if isinstance(v, bool | np.bool_):
        return "yes" if v else "–"
    return "–" if is_off(field, v) or v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def diagnostic_spec(t: pd.DataFrame) -> tuple[list[str], str]:
    """The spec fields (SPEC_FIELDS) that differ between the table's arms (its columns) and "field value, ..." for
    the rest (an option every arm has off is left out)."""
    fields = [f for f in SPEC_FIELDS if f in t.columns]
    varying = [f for f in fields if t[f].map(lambda v, f=f: _spec_value(f, v)).nunique() > 1]
    first = {f: t[f].iloc[0] for f in fields}
    shown = [f for f in fields if f not in varying and not is_off(f, first[f])]
    return varying, ", ".join(f"{spec_label(f)} {_spec_value(f, first[f])}" for f in shown)


def _estimate(r, m: str) -> str:
    """ "mean [lo, hi]", with "(n k)" when fewer instances than the row's have a value."""
    n = getattr(r, f"{m}_n")
    if n == 0:
        return "– (estimate 0)" if m.startswith("cosine") else "–"
    ci_ = f" [{g3(getattr(r, f'{m}_lo'))}, {g3(getattr(r, f'{m}_hi'))}]" if n > 1 else ""
    return f"{g3(getattr(r, f'{m}_mean'))}{ci_}" + (f" (n {n})" if n < r.instances else "")


def diagnostics_table(t: pd.DataFrame) -> str:
    """One row per arm x regime: the varying spec fields, regime, instances and runs, each metric's mean over
    instances with its CI, and the noise floor of the relative bias (mean)."""
    varying, _ = diagnostic_spec(t)
    rows = []
    for r in t.itertuples():
        regime = "on-policy" if r.regime == "on_policy" else f"off-policy ({r.updates} updates)"
        spec = {spec_label(f): _spec_value(f, getattr(r, f)) for f in varying}
        row = {"arm": r.arm, **spec, "regime": regime, "n (runs)": f"{r.instances} ({r.runs})"}
        for m, name in DIAGNOSTIC_COLUMNS.items():
            row[name] = _estimate(r, m)
            if m == "rel_bias":
                row["noise floor"] = g3(r.rel_bias_noise_mean)
        rows.append(row)
    return md(rows)
