"""The words and tables of the analysis: the 3-5 sentence answer, report.md and stats.json.

Everything here formats results computed by ablations/analysis.py; no statistics are computed here except the
verdict counts. Every number in the answer appears in a table of the report.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ablations import stats as S
from ablations.config import Params
from ablations.grid import BASELINE

if TYPE_CHECKING:
    from ablations.analysis import Results

FAMILIES = {
    "coef": "final gold at matched coefficient",
    "kl": "gold at matched KL",
    "frontier": "frontier",
}


def budget_column(budget: float) -> str:
    """Column of the runs table with gold at KL budget ``budget`` (nats)."""
    return f"gold_at_kl_{budget:g}"


# ---------------------------------------------------------------- the answer

MATERIAL, NEGLIGIBLE = "difference", "difference within margin"


def _counts(df: pd.DataFrame) -> dict[str, int]:
    """Verdict counts, with detected differences split by whether TOST also puts them within ±margin (Lakens
    2017: "statistically different but practically equivalent")."""
    diff = df.verdict == S.DIFFERENCE
    return {
        MATERIAL: int((diff & ~df.within_margin.astype(bool)).sum()),
        NEGLIGIBLE: int((diff & df.within_margin.astype(bool)).sum()),
        S.EQUIVALENT: int((df.verdict == S.EQUIVALENT).sum()),
        S.INCONCLUSIVE: int((df.verdict == S.INCONCLUSIVE).sum()),
    }


def _level(alpha: float) -> str:
    """ "95% CI" for alpha = 0.05: the label of the (1 - alpha) confidence interval."""
    return f"{100 * (1 - alpha):.0f}% CI"


def _ci(r) -> str:
    """ "+0.123 gold, 95% CI [+0.1, +0.2]" for one comparison row."""
    return f"{r['diff']:+.3f} gold, {_level(r['alpha'])} [{r['ci_lo']:+.3f}, {r['ci_hi']:+.3f}]"


def _largest(df: pd.DataFrame):
    """The comparison with the largest |difference| among differences not within the margin, else among all
    detected differences, else among all testable comparisons; None if there is none."""
    diff = df.verdict == S.DIFFERENCE
    for pool in (df[diff & ~df.within_margin.astype(bool)], df[diff], df[np.isfinite(df.ci_lo)]):
        if len(pool):
            return pool.loc[pool["diff"].abs().idxmax()]
    return None


def _verdict_words(r) -> str:
    """A comparison's verdict in words for the answer."""
    if r["verdict"] == S.DIFFERENCE:
        return "a difference within the margin" if r["within_margin"] else "a difference"
    return r["verdict"]


def write_answer(params: Params, comparisons: pd.DataFrame, runs: pd.DataFrame) -> tuple[str, str]:
    """The 3-5 sentence answer, generated from the comparison, verdict-count and reach tables (every number
    appears in one), and a headline: "matters", "does not matter" or "unsettled". The headline is judged on the
    KL arms in the matched-KL and frontier families, where a coefficient's different meaning across placements
    cannot drive the result: "matters" if any shows a difference not shown to be within ±margin; "does not
    matter" if every one is within ±margin (equivalent, or a real difference smaller than the margin)."""
    a = params.analysis
    ref, alpha, margin = a.reference_arm, a.alpha, a.margin
    kla = comparisons[comparisons.arm != BASELINE]
    fam = {f: kla[kla.family == f] for f in FAMILIES}
    n = {f: len(df) for f, df in fam.items()}
    c = {f: _counts(df) for f, df in fam.items()}
    fair = pd.concat([fam["kl"], fam["frontier"]])
    cf = _counts(fair)
    s = []
    if cf[MATERIAL]:
        headline = "matters"
        s.append(
            f"Yes, on this task where the KL penalty goes changes gold reward even at matched KL: "
            f"{c['kl'][MATERIAL]} of {n['kl']} matched-KL comparisons and {c['frontier'][MATERIAL]} of "
            f"{n['frontier']} frontier comparisons against {ref} show a difference not shown to be within "
            f"±{margin:g} gold (Holm-corrected within each family, alpha = {alpha:g})"
        )
    elif len(fair) and cf[S.EQUIVALENT] + cf[NEGLIGIBLE] == len(fair):
        headline = "does not matter"
        s.append(
            f"No, not beyond ±{margin:g} gold on this task: at matched KL every variant is equivalent to {ref} "
            f"within the margin (all {n['kl']} matched-KL and {n['frontier']} frontier comparisons, TOST, "
            f"Holm-corrected, alpha = {alpha:g}; with a real difference smaller than the margin in "
            f"{cf[NEGLIGIBLE]} of them)"
        )
    else:
        headline = "unsettled"
        s.append(
            f"Not settled by these seeds: at matched KL no variant differs detectably from {ref} by more than "
            f"the margin (alpha = {alpha:g}, Holm), but only {cf[S.EQUIVALENT] + cf[NEGLIGIBLE]} of {len(fair)} "
            f"matched-KL and frontier comparisons are shown to be within ±{margin:g} gold; the other "
            f"{cf[S.INCONCLUSIVE]} are inconclusive"
        )
    r = _largest(fam["coef"])
    if r is not None:
        cc = c["coef"]
        s.append(
            f"At matched coefficient, where the same number means a different strength in each placement, "
            f"{cc[MATERIAL] + cc[NEGLIGIBLE]} of {n['coef']} comparisons show a Holm-significant difference "
            f"({cc[S.EQUIVALENT]} equivalent, {cc[S.INCONCLUSIVE]} inconclusive); the largest gap is "
            f"{r.arm} at coef {r.level:g} ({_ci(r)}, {_verdict_words(r)}; mean {r.mean_arm:.3f} vs "
            f"{r.mean_ref:.3f} for {ref})"
        )
    parts = []
    for f in ("kl", "frontier"):
        r = _largest(fam[f])
        if r is not None:
            where = (
                f"at matched KL the largest gap is {r.arm} at {r.level:g} nats"
                if f == "kl"
                else f"on the frontier summary (mean gold over KL budgets 0-{max(a.kl_budgets):g} nats) it is {r.arm}"
            )
            parts.append(f"{where} ({_ci(r)}, {_verdict_words(r)})")
    if parts:
        top = max(a.kl_budgets)
        text = "; ".join(parts)
        s.append(
            text[0].upper()
            + text[1:]
            + f"; {int(runs[budget_column(top)].notna().sum())} of {len(runs)} runs reached the {top:g}-nat budget"
        )
    base = comparisons[(comparisons.arm == BASELINE) & (comparisons.family == "coef")]
    if len(base):
        cb = _counts(base)
        lo, hi = base.mean_ref.min(), base.mean_ref.max()
        span = f"{lo:.3f}" if f"{lo:.3f}" == f"{hi:.3f}" else f"{lo:.3f} to {hi:.3f}"
        s.append(
            f"Without any KL penalty the final gold is {base.mean_arm.iloc[0]:.3f}, against {span} for {ref} "
            f"{'across coefficients ' if len(base) > 1 else ''}"
            f"(of {len(base)} comparisons: difference not within the margin {cb[MATERIAL]}, difference within "
            f"it {cb[NEGLIGIBLE]}, equivalent {cb[S.EQUIVALENT]}, inconclusive {cb[S.INCONCLUSIVE]})"
        )
    need = comparisons.seeds_needed[comparisons.verdict == S.INCONCLUSIVE].dropna()
    if len(need):
        fmt = lambda x: f"more than {S.MAX_SEEDS}" if x == math.inf else f"{int(x)}"
        span = fmt(need.min()) if need.min() == need.max() else f"{fmt(need.min())} to {fmt(need.max())}"
        s[-1] += (
            f"; the {len(need)} inconclusive comparisons would need about {span} seeds per arm to detect a "
            f"±{margin:g} difference (power {a.power:g})"
        )
    return " ".join(x + "." for x in s[:5]), headline


# ---------------------------------------------------------------- tables and report


def _f(x, nd: int = 3, sign: bool = False) -> str:
    """A number with ``nd`` decimals (signed if ``sign``), "–" for None/NaN/inf."""
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "–"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def _p(p: float) -> str:
    """A p-value for a table: 3 decimals, "<0.001", or "–"."""
    return "–" if not np.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def _md(df: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table (pandas to_markdown / tabulate), cells kept as given."""
    return df.to_markdown(index=False, disable_numparse=True)


def _verdict_cell(r) -> str:
    """A comparison's verdict for the tables, with the seed recommendation or the within-margin flag."""
    if r.verdict == S.INCONCLUSIVE and np.isnan(r.p):
        return "inconclusive (too few runs)"
    if r.verdict == S.INCONCLUSIVE:
        n = r.seeds_needed
        return f"inconclusive (~{'>' + str(S.MAX_SEEDS) if n == math.inf else int(n)} seeds)"
    if r.verdict == S.DIFFERENCE and r.within_margin:
        return "difference (within margin)"
    return r.verdict


def comparison_table(df: pd.DataFrame) -> str:
    """Markdown table of a family of comparisons."""
    rows = [
        {
            "comparison": r.label,
            "n arm/ref": f"{r.n_arm}/{r.n_ref}",
            "test": "paired t" if r.paired else "Welch t",
            "mean arm": _f(r.mean_arm),
            "mean ref": _f(r.mean_ref),
            "Δ": _f(r.diff, sign=True),
            _level(r.alpha): f"[{_f(r.ci_lo, sign=True)}, {_f(r.ci_hi, sign=True)}]",
            "effect": f"{r.effect_name} {_f(r.effect, 2, sign=True)}",
            "p (t)": _p(r.p),
            "p (perm)": _p(r.p_perm),
            "p Holm": _p(r.p_holm),
            "p TOST Holm": _p(r.p_equiv_holm),
            "verdict": _verdict_cell(r),
        }
        for r in df.itertuples()
    ]
    return _md(pd.DataFrame(rows))


def counts_table(comparisons: pd.DataFrame) -> str:
    """Markdown table: verdict counts per family, KL arms and the no-KL baseline separately."""
    rows = []
    for fam, name in FAMILIES.items():
        for who, sel in (("KL arms", comparisons.arm != BASELINE), ("no-KL baseline", comparisons.arm == BASELINE)):
            df = comparisons[(comparisons.family == fam) & sel]
            if len(df):
                rows.append(
                    {"family": name, "arms": who, "comparisons": len(df), **{k: str(v) for k, v in _counts(df).items()}}
                )
    if not rows:
        return "(no comparisons)"
    rows = [{("difference, not within margin" if k == MATERIAL else k): v for k, v in r.items()} for r in rows]
    return _md(pd.DataFrame(rows))


def _pm(m, sd) -> str:
    """ "mean ± sd"."""
    return f"{_f(m)} ± {_f(sd)}"


def render_report(res: Results, images: dict[str, str]) -> str:
    """report.md: the answer, the caution, the protocol, the tables, then the plots (relative image links)."""
    p, a = res.params, res.params.analysis
    c = res.comparisons
    fam_sizes = ", ".join(f"{name} ({int((c.family == f).sum())} comparisons)" for f, name in FAMILIES.items())
    units = next(iter(p.tasks().values())).instances  # interim: the task instances are the unit
    n_seeds = len(units)
    exact_floor = 2 / 2**n_seeds
    L = [
        "# Does it matter where the KL penalty goes? PPO-RLHF ablation report",
        "",
        f"**Answer ({res.headline}).** {res.answer}",
        "",
        "> **Caution.** These results come from a synthetic task (a small grammar with an exact gold reward, a "
        "tiny transformer policy and a learned proxy reward model), with "
        f"{n_seeds} seeds per cell. They show how the KL variants behave on this task under this protocol; "
        "they are not evidence about large language models until reproduced on one.",
        "",
        "## Protocol (fixed in params.yaml before running)",
        "",
        f"- Primary metric: `{a.metric}` (gold reward on the held-out prompts at the end of training). "
        f"Reference arm: `{a.reference_arm}`. Every other arm, and the no-KL baseline (`{BASELINE}`, one run "
        "per seed, compared at every coefficient), is compared with it.",
        f"- Unit: the seed ({n_seeds} task instances: {', '.join(map(str, units))}); arms share seeds, so tests are "
        "paired t-tests on per-seed differences (Welch's t-test when the seeds do not match, e.g. when some runs "
        "never reach a KL budget). Difference of means with an unadjusted 95% CI; effect size Cohen's d_z "
        "(paired) or Hedges' g (Welch).",
        "- Cross-check: exact permutation test (sign flips of the per-seed differences; relabelling for Welch). "
        f"With {n_seeds} paired seeds its smallest possible two-sided p is 2/2^{n_seeds} = {exact_floor:.4f}.",
        f"- Equivalence: TOST against ±{a.margin:g} gold. Holm correction within each family, separately for the "
        f"difference and the equivalence p-values, at alpha = {a.alpha:g}. Families: {fam_sizes}.",
        f"- Verdict: *difference* if Holm-adjusted p < {a.alpha:g}; else *equivalent* if the Holm-adjusted TOST "
        f"p < {a.alpha:g}; else *inconclusive*, with the seeds per arm a t-test at alpha = {a.alpha:g} would need "
        f"for power {a.power:g} against a true difference of {a.margin:g}, taking the observed SD as the truth "
        "(statsmodels power; at least n + 1, capped at 1000; unadjusted alpha, so a lower bound under Holm).",
        f"- Matched KL: for each run, gold at the first eval where its exact KL(π‖π_ref) reaches each budget "
        f"({', '.join(f'{b:g}' for b in a.kl_budgets)} nats per response), linearly interpolated between the two "
        "evals around the crossing; runs that never reach a budget give no value there. An arm's values are "
        "averaged over its coefficients within a seed (one value per arm and seed).",
        f"- Frontier: per run, the mean over KL budgets κ in [0, {max(a.kl_budgets):g}] nats of the gold at the "
        "first crossing of κ (the run's final gold for κ beyond the largest KL it reached), i.e. the normalised "
        "area under its gold-vs-KL-budget curve over the whole trajectory; averaged over coefficients within a "
        "seed like the matched-KL values.",
        "- No seed, run or checkpoint is ever selected by its result.",
        "",
        "## Verdict counts",
        "",
        counts_table(c),
        "",
    ]
    sections = {
        "coef": "## Final gold at matched coefficient",
        "kl": "## Gold at matched KL",
        "frontier": "## Frontier (normalised gold-vs-KL-budget area)",
    }
    for fam, title in sections.items():
        L += [title, ""]
        if fam == "kl":
            reach = res.reach.copy()
            reach["max KL reached, median over runs (nats)"] = reach.iloc[:, -1].map(_f)
            L += [
                "Runs that reached each budget (of all runs of the arm, over all coefficients):",
                "",
                _md(reach.astype(str)),
                "",
            ]
        L += [comparison_table(c[c.family == fam]), ""]
    ct = res.cell_table
    L += [
        "## Factorial view: placement × estimator × coefficient",
        "",
        "Mean ± SD over seeds per cell.",
        "",
        _md(
            pd.DataFrame(
                {
                    "arm": ct.arm,
                    "target": ct.target,
                    "placement": ct.placement,
                    "estimator": ct.estimator,
                    "coef": ct.coef.map(lambda x: f"{x:g}"),
                    "n": ct.n.astype(str),
                    a.metric: [_pm(m, s) for m, s in zip(ct[f"{a.metric}_mean"], ct[f"{a.metric}_sd"])],
                    "final KL (nats)": [_pm(m, s) for m, s in zip(ct.final_kl_mean, ct.final_kl_sd)],
                    "frontier": [_pm(m, s) for m, s in zip(ct.frontier_mean, ct.frontier_sd)],
                }
            )
        ),
        "",
    ]
    for label, (formula, table) in res.anova.items():
        t = table.reset_index().rename(columns={"index": "term"})
        t = pd.DataFrame(
            {
                "term": t.term,
                "sum sq": t.sum_sq.map(lambda x: f"{x:.4g}"),
                "df": t.df.map(lambda x: f"{x:g}"),
                "F": t.F.map(lambda x: _f(x, 2)),
                "p": t["PR(>F)"].map(_p),
            }
        )
        L += [
            f"**{label}**: type-II ANOVA, `{formula}` (seed as a block; descriptive, not Holm-corrected)",
            "",
            _md(t),
            "",
        ]
    L += ["## Plots", ""]
    for title, name in images.items():
        L += [f"### {title}", "", f"![{title}]({name})", ""]
    perm_disagree = int(((c.p < a.alpha) != (c.p_perm < a.alpha))[np.isfinite(c.p_perm)].sum())
    L += [
        "## Notes",
        "",
        f"- The permutation test and the t-test disagree about p < {a.alpha:g} (both unadjusted) in "
        f"{perm_disagree} of {len(c)} comparisons; with few seeds the exact test cannot reach small p-values.",
        "- CIs are unadjusted; verdicts use Holm-adjusted p-values, so a CI may exclude 0 without a verdict of "
        "difference.",
        "- At matched KL an arm's value per seed averages the coefficients whose runs reached the budget, so two "
        "arms may average different coefficients at a high budget (see the reach table); the frontier summary "
        "uses every run.",
        "- The ANOVAs treat the coefficient as a factor within a placement; a coefficient means different things "
        "in different placements, so they are not compared across placements.",
        "- All tables: reports/comparisons.csv (every comparison) and reports/runs.csv (every run).",
        "",
    ]
    return "\n".join(L)


def _clean(x):
    """JSON-safe copy: numpy scalars to Python, NaN/inf to None (strict JSON has no NaN)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def stats_summary(res: Results) -> dict:
    """stats.json (DVC metrics): headline, run and seed counts and the protocol at the top level; verdict counts per
    family, mean final gold per cell and the difference to the reference of every comparison one level down.
    NaN/inf become null."""
    a, c = res.params.analysis, res.comparisons
    return _clean(
        {
            "headline": res.headline,
            "n_runs": len(res.runs),
            "n_seeds": len(next(iter(res.params.tasks().values())).instances),
            "metric": a.metric,
            "reference_arm": a.reference_arm,
            "margin": a.margin,
            "alpha": a.alpha,
            "power": a.power,
            "verdicts": {
                f: {
                    "n": int((c.family == f).sum()),
                    **{k.replace(" ", "_"): v for k, v in _counts(c[c.family == f]).items()},
                }
                for f in FAMILIES
            },
            a.metric: {
                f"{r.arm}@{r.coef:g}" if r.arm != BASELINE else r.arm: r[f"{a.metric}_mean"]
                for _, r in res.cell_table.iterrows()
            },
            "diff": {
                f"{r.family}/{r.arm}" + ("" if r.level is None or not np.isfinite(r.level) else f"@{r.level:g}"): r[
                    "diff"
                ]
                for _, r in c.iterrows()
            },
        }
    )
