"""Analysis of the KL-placement grid: does it matter where the KL penalty goes?

Reads every cell of the current params.yaml grid from its run directory (summary.json, evals.csv; never MLflow,
and never a stale directory of a cell no longer in the grid), applies the protocol of ablations/stats.py
(params.yaml ``analysis``) in three families, and writes the report:

    coef      final gold at matched coefficient: each arm (and the no-KL baseline) vs the reference arm, per coef
    kl        gold at matched KL: gold at the first crossing of each KL budget, averaged over an arm's
              coefficients within a seed, vs the reference arm, per budget
    frontier  normalised area under each run's gold-vs-KL-budget curve, averaged the same way, vs the reference arm

plus a factorial view (estimator x coefficient within each placement) and plots. Every number is a mean over
seeds or a per-seed value; no seed or checkpoint is ever picked by its result.

Entry points: analyse(params, root) -> Results; write_outputs(results, out_dir) -> list[Path]; run(params, out_dir,
root) does both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import statsmodels.formula.api as smf
from statsmodels.stats.anova import anova_lm

from ablations import stats as S
from ablations.config import Params
from ablations.grid import BASELINE, Cell, cells

FAMILIES = {
    "coef": "final gold at matched coefficient",
    "kl": "gold at matched KL",
    "frontier": "frontier",
}
SUMMARY_KEYS = ("arm", "coef", "seed", "final_gold", "final_kl")
EVAL_COLUMNS = ("iteration", "gold", "kl")
FIGURES = "figures"  # sub-folder of the output folder holding the PNGs (a DVC out of its own)
OUTPUTS = ("stats.json", "comparisons.csv", "runs.csv", f"{FIGURES}/gold_vs_kl.png", f"{FIGURES}/learning_curves.png",
           f"{FIGURES}/forest.png", "report.md")  # relative to the output folder; report.md last


class MissingResultsError(FileNotFoundError):
    """A cell of the grid has no (or unreadable, or someone else's) results; the message names its stage."""


def budget_column(budget: float) -> str:
    """Column of the runs table with gold at KL budget ``budget`` (nats)."""
    return f"gold_at_kl_{budget:g}"


@dataclass
class Results:
    """Everything the report is made of. ``runs``: one row per grid cell (summary.json fields, the arm's spec,
    gold at each KL budget, frontier). ``evals``: every eval row of every run, tagged with arm/coef/seed.
    ``comparisons``: one row per comparison (stats.Comparison fields). ``reach``: per arm and budget, runs that
    reached it. ``cell_table``: mean and SD per (arm, coef). ``anova``: placement label -> ANOVA table."""

    params: Params
    runs: pd.DataFrame
    evals: pd.DataFrame
    comparisons: pd.DataFrame
    reach: pd.DataFrame
    cell_table: pd.DataFrame
    anova: dict[str, tuple[str, pd.DataFrame]] = field(default_factory=dict)
    answer: str = ""
    headline: str = ""


# ---------------------------------------------------------------- loading

def _load_cell(cell: Cell, root: Path) -> tuple[dict, pd.DataFrame]:
    """summary.json and evals.csv (sorted by iteration) of one cell; MissingResultsError naming its stage if
    either is missing, unreadable, lacks a needed field, or holds another cell's results."""
    d = root / cell.out_dir
    summary_path, evals_path = d / "summary.json", d / "evals.csv"
    for p in (summary_path, evals_path):
        if not p.is_file():
            raise MissingResultsError(f"stage {cell.stage}: {p} not found")
    try:
        summary = json.loads(summary_path.read_text())
        evals = pd.read_csv(evals_path)
    except (OSError, ValueError) as e:
        raise MissingResultsError(f"stage {cell.stage}: cannot read {d}: {e}") from None
    lacking = [k for k in SUMMARY_KEYS if k not in summary] + [c for c in EVAL_COLUMNS if c not in evals.columns]
    if lacking:
        raise MissingResultsError(f"stage {cell.stage}: {d} lacks {', '.join(lacking)}")
    if (summary["arm"], int(summary["seed"])) != (cell.arm, cell.seed) or (
            cell.arm != BASELINE and not math.isclose(float(summary["coef"]), cell.coef)):
        raise MissingResultsError(f"stage {cell.stage}: {summary_path} holds arm={summary['arm']} "
                                  f"coef={summary['coef']} seed={summary['seed']}; rerun the stage")
    if evals.empty:
        raise MissingResultsError(f"stage {cell.stage}: {evals_path} has no rows")
    return summary, evals.sort_values("iteration").reset_index(drop=True)


def load_runs(params: Params, root: Path | str = ".") -> tuple[pd.DataFrame, pd.DataFrame]:
    """Reads summary.json and evals.csv of every cell of ``cells(params)`` under ``root`` (only those: stale
    directories are never listed). Returns (runs, evals). Raises MissingResultsError naming every missing stage."""
    root = Path(root)
    rows, evals, problems = [], [], []
    for cell in cells(params):
        try:
            summary, ev = _load_cell(cell, root)
        except MissingResultsError as e:
            problems.append(str(e))
            continue
        spec = cell.kl
        rows.append({**summary, "arm": cell.arm, "coef": cell.coef, "seed": cell.seed, "stage": cell.stage,
                     "target": spec.target, "placement": spec.placement, "estimator": spec.estimator or "-"})
        evals.append(ev.assign(arm=cell.arm, coef=cell.coef, seed=cell.seed))
    if problems:
        shown = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise MissingResultsError(f"analysis needs every cell of the params.yaml grid; {len(problems)} stage(s) "
                                  f"have no usable results (run `dvc repro` for them):\n  {shown}")
    return pd.DataFrame(rows), pd.concat(evals, ignore_index=True)


def add_budget_metrics(runs: pd.DataFrame, evals: pd.DataFrame, budgets: list[float]) -> pd.DataFrame:
    """Adds to each run gold at every KL budget (stats.gold_at_kl, first crossing), ``max_kl`` (largest eval KL)
    and ``frontier`` (stats.budget_curve_auc up to the largest budget), from its eval trajectory in training order."""
    runs = runs.copy()
    by_run = {k: g for k, g in evals.groupby(["arm", "coef", "seed"], sort=False)}
    for b in budgets:
        runs[budget_column(b)] = [S.gold_at_kl(by_run[k].kl, by_run[k].gold, b)
                                  for k in zip(runs.arm, runs.coef, runs.seed)]
    runs["max_kl"] = [float(by_run[k].kl.max()) for k in zip(runs.arm, runs.coef, runs.seed)]
    runs["frontier"] = [S.budget_curve_auc(by_run[k].kl, by_run[k].gold, max(budgets))
                        for k in zip(runs.arm, runs.coef, runs.seed)]
    return runs


# ---------------------------------------------------------------- comparisons

def per_seed(runs: pd.DataFrame, arm: str, column: str, coef: float | None = None) -> pd.Series:
    """One value per seed of ``arm``: ``column`` at ``coef``, or (coef None) its mean over the arm's coefficients
    within each seed, skipping NaN (a budget the run never reached); the baseline has one run per seed."""
    sel = runs[runs.arm == arm]
    if coef is not None and arm != BASELINE:
        sel = sel[np.isclose(sel.coef, coef)]
    return sel.groupby("seed")[column].mean()  # pandas mean skips NaN; all-NaN -> NaN, dropped by stats.compare


def compare_all(params: Params, runs: pd.DataFrame) -> pd.DataFrame:
    """Every comparison of the protocol against ``analysis.reference_arm``, Holm-adjusted and decided within each
    family (stats.compare, stats.decide). Arms in params order, the no-KL baseline last."""
    a = params.analysis
    ref = a.reference_arm
    others = [x for x in params.grid.arms if x != ref] + [BASELINE]
    kw = dict(margin=a.margin, alpha=a.alpha, ref_name=ref)
    fams: dict[str, list[S.Comparison]] = {k: [] for k in FAMILIES}
    for coef in params.grid.coefs:
        for arm in others:
            fams["coef"].append(S.compare(per_seed(runs, arm, a.metric, coef), per_seed(runs, ref, a.metric, coef),
                                          family="coef", label=f"{arm} @ coef {coef:g}", arm_name=arm,
                                          level=coef, **kw))
    for b in a.kl_budgets:
        col = budget_column(b)
        for arm in others:
            fams["kl"].append(S.compare(per_seed(runs, arm, col), per_seed(runs, ref, col), family="kl",
                                        label=f"{arm} @ KL {b:g} nats", arm_name=arm, level=b, **kw))
    for arm in others:
        fams["frontier"].append(S.compare(per_seed(runs, arm, "frontier"), per_seed(runs, ref, "frontier"),
                                          family="frontier", label=f"{arm} frontier", arm_name=arm, **kw))
    rows = [c.row() for fam in fams.values() for c in S.decide(fam, power=a.power)]
    return pd.DataFrame(rows)


def reach_table(params: Params, runs: pd.DataFrame) -> pd.DataFrame:
    """Per arm and KL budget: how many runs reached the budget (the rest give no value there), of how many."""
    out = []
    for arm, g in runs.groupby("arm", sort=False):
        row = {"arm": arm, "runs": len(g)}
        for b in params.analysis.kl_budgets:
            row[f"reached {b:g} nats"] = int(g[budget_column(b)].notna().sum())
        row["max KL reached, median over runs (nats)"] = float(g.max_kl.median())
        out.append(row)
    return pd.DataFrame(out)


# ---------------------------------------------------------------- factorial view

def cell_table(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Mean, SD and n over seeds of the metric, final KL and frontier per (arm, coef), with the arm's spec."""
    keys = ["target", "placement", "estimator", "arm", "coef"]
    g = runs.groupby(keys, sort=False)
    t = g[metric].agg(["count", "mean", "std"]).rename(columns={"count": "n", "mean": f"{metric}_mean",
                                                                 "std": f"{metric}_sd"})
    t["final_kl_mean"], t["final_kl_sd"] = g.final_kl.mean(), g.final_kl.std()
    t["frontier_mean"], t["frontier_sd"] = g.frontier.mean(), g.frontier.std()
    return t.reset_index()


def factorial_anova(runs: pd.DataFrame, metric: str) -> dict[str, tuple[str, pd.DataFrame]]:
    """Within each (target, placement) group of arms: a type-II ANOVA (statsmodels ols + anova_lm) of the metric
    on variant x coefficient, with seed as an additive block because seeds are shared across cells. The variant
    factor is the estimator when it identifies the arm within the group, else the arm name; a group with a
    single variant gets a one-way ANOVA on the coefficient. Returns label -> (formula, table)."""
    out = {}
    kl_runs = runs[runs.arm != BASELINE]
    for (target, placement), g in kl_runs.groupby(["target", "placement"], sort=False):
        variant = "estimator" if g.groupby("estimator").arm.nunique().max() == 1 else "arm"
        terms = []
        if g[variant].nunique() > 1 and g.coef.nunique() > 1:
            terms.append(f"C({variant}) * C(coef)")
        elif g[variant].nunique() > 1:
            terms.append(f"C({variant})")
        elif g.coef.nunique() > 1:
            terms.append("C(coef)")
        else:
            continue
        if g.seed.nunique() > 1:
            terms.append("C(seed)")
        formula = f"{metric} ~ " + " + ".join(terms)
        model = smf.ols(formula, data=g).fit()
        if model.df_resid < 1:
            continue
        label = f"placement {placement}" + ("" if target == "reference" else f", target {target}")
        out[label] = (formula, anova_lm(model, typ=2))
    return out


# ---------------------------------------------------------------- the answer

MATERIAL, NEGLIGIBLE = "difference", "difference within margin"


def _counts(df: pd.DataFrame) -> dict[str, int]:
    """Verdict counts, with detected differences split by whether TOST also puts them within ±margin (Lakens
    2017: "statistically different but practically equivalent")."""
    diff = df.verdict == S.DIFFERENCE
    return {MATERIAL: int((diff & ~df.within_margin.astype(bool)).sum()),
            NEGLIGIBLE: int((diff & df.within_margin.astype(bool)).sum()),
            S.EQUIVALENT: int((df.verdict == S.EQUIVALENT).sum()),
            S.INCONCLUSIVE: int((df.verdict == S.INCONCLUSIVE).sum())}


def _level(alpha: float) -> str:
    """"95% CI" for alpha = 0.05: the label of the (1 - alpha) confidence interval."""
    return f"{100 * (1 - alpha):.0f}% CI"


def _ci(r) -> str:
    """"+0.123 gold, 95% CI [+0.1, +0.2]" for one comparison row."""
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
        s.append(f"Yes, on this task where the KL penalty goes changes gold reward even at matched KL: "
                 f"{c['kl'][MATERIAL]} of {n['kl']} matched-KL comparisons and {c['frontier'][MATERIAL]} of "
                 f"{n['frontier']} frontier comparisons against {ref} show a difference not shown to be within "
                 f"±{margin:g} gold (Holm-corrected within each family, alpha = {alpha:g})")
    elif len(fair) and cf[S.EQUIVALENT] + cf[NEGLIGIBLE] == len(fair):
        headline = "does not matter"
        s.append(f"No, not beyond ±{margin:g} gold on this task: at matched KL every variant is equivalent to {ref} "
                 f"within the margin (all {n['kl']} matched-KL and {n['frontier']} frontier comparisons, TOST, "
                 f"Holm-corrected, alpha = {alpha:g}; with a real difference smaller than the margin in "
                 f"{cf[NEGLIGIBLE]} of them)")
    else:
        headline = "unsettled"
        s.append(f"Not settled by these seeds: at matched KL no variant differs detectably from {ref} by more than "
                 f"the margin (alpha = {alpha:g}, Holm), but only {cf[S.EQUIVALENT] + cf[NEGLIGIBLE]} of {len(fair)} "
                 f"matched-KL and frontier comparisons are shown to be within ±{margin:g} gold; the other "
                 f"{cf[S.INCONCLUSIVE]} are inconclusive")
    r = _largest(fam["coef"])
    if r is not None:
        cc = c["coef"]
        s.append(f"At matched coefficient, where the same number means a different strength in each placement, "
                 f"{cc[MATERIAL] + cc[NEGLIGIBLE]} of {n['coef']} comparisons show a Holm-significant difference "
                 f"({cc[S.EQUIVALENT]} equivalent, {cc[S.INCONCLUSIVE]} inconclusive); the largest gap is "
                 f"{r.arm} at coef {r.level:g} ({_ci(r)}, {_verdict_words(r)}; mean {r.mean_arm:.3f} vs "
                 f"{r.mean_ref:.3f} for {ref})")
    parts = []
    for f in ("kl", "frontier"):
        r = _largest(fam[f])
        if r is not None:
            where = (f"at matched KL the largest gap is {r.arm} at {r.level:g} nats" if f == "kl" else
                     f"on the frontier summary (mean gold over KL budgets 0-{max(a.kl_budgets):g} nats) it is {r.arm}")
            parts.append(f"{where} ({_ci(r)}, {_verdict_words(r)})")
    if parts:
        top = max(a.kl_budgets)
        text = "; ".join(parts)
        s.append(text[0].upper() + text[1:] +
                 f"; {int(runs[budget_column(top)].notna().sum())} of {len(runs)} runs reached the {top:g}-nat budget")
    base = comparisons[(comparisons.arm == BASELINE) & (comparisons.family == "coef")]
    if len(base):
        cb = _counts(base)
        lo, hi = base.mean_ref.min(), base.mean_ref.max()
        span = f"{lo:.3f}" if f"{lo:.3f}" == f"{hi:.3f}" else f"{lo:.3f} to {hi:.3f}"
        s.append(f"Without any KL penalty the final gold is {base.mean_arm.iloc[0]:.3f}, against {span} for {ref} "
                 f"{'across coefficients ' if len(base) > 1 else ''}"
                 f"(of {len(base)} comparisons: difference not within the margin {cb[MATERIAL]}, difference within "
                 f"it {cb[NEGLIGIBLE]}, equivalent {cb[S.EQUIVALENT]}, inconclusive {cb[S.INCONCLUSIVE]})")
    need = comparisons.seeds_needed[comparisons.verdict == S.INCONCLUSIVE].dropna()
    if len(need):
        fmt = lambda x: f"more than {S.MAX_SEEDS}" if x == math.inf else f"{int(x)}"  # noqa: E731
        span = fmt(need.min()) if need.min() == need.max() else f"{fmt(need.min())} to {fmt(need.max())}"
        s[-1] += (f"; the {len(need)} inconclusive comparisons would need about {span} seeds per arm to detect a "
                  f"±{margin:g} difference (power {a.power:g})")
    return " ".join(x + "." for x in s[:5]), headline


# ---------------------------------------------------------------- putting it together

def analyse(params: Params, root: Path | str = ".") -> Results:
    """Loads the grid's runs under ``root`` and computes every table of the report (no files written)."""
    a = params.analysis
    runs, evals = load_runs(params, root)
    runs = add_budget_metrics(runs, evals, a.kl_budgets)
    comparisons = compare_all(params, runs)
    res = Results(params=params, runs=runs, evals=evals, comparisons=comparisons, reach=reach_table(params, runs),
                  cell_table=cell_table(runs, a.metric), anova=factorial_anova(runs, a.metric))
    res.answer, res.headline = write_answer(params, comparisons, runs)
    return res


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
    rows = [{
        "comparison": r.label,
        "n arm/ref": f"{r.n_arm}/{r.n_ref}",
        "test": "paired t" if r.paired else "Welch t",
        "mean arm": _f(r.mean_arm), "mean ref": _f(r.mean_ref),
        "Δ": _f(r.diff, sign=True), _level(r.alpha): f"[{_f(r.ci_lo, sign=True)}, {_f(r.ci_hi, sign=True)}]",
        "effect": f"{r.effect_name} {_f(r.effect, 2, sign=True)}",
        "p (t)": _p(r.p), "p (perm)": _p(r.p_perm), "p Holm": _p(r.p_holm), "p TOST Holm": _p(r.p_equiv_holm),
        "verdict": _verdict_cell(r),
    } for r in df.itertuples()]
    return _md(pd.DataFrame(rows))


def counts_table(comparisons: pd.DataFrame) -> str:
    """Markdown table: verdict counts per family, KL arms and the no-KL baseline separately."""
    rows = []
    for fam, name in FAMILIES.items():
        for who, sel in (("KL arms", comparisons.arm != BASELINE), ("no-KL baseline", comparisons.arm == BASELINE)):
            df = comparisons[(comparisons.family == fam) & sel]
            if len(df):
                rows.append({"family": name, "arms": who, "comparisons": len(df),
                             **{k: str(v) for k, v in _counts(df).items()}})
    if not rows:
        return "(no comparisons)"
    rows = [{("difference, not within margin" if k == MATERIAL else k): v for k, v in r.items()} for r in rows]
    return _md(pd.DataFrame(rows))


def _pm(m, sd) -> str:
    """"mean ± sd"."""
    return f"{_f(m)} ± {_f(sd)}"


def render_report(res: Results, images: dict[str, str]) -> str:
    """report.md: the answer, the caution, the protocol, the tables, then the plots (relative image links)."""
    p, a = res.params, res.params.analysis
    c = res.comparisons
    fam_sizes = ", ".join(f"{name} ({int((c.family == f).sum())} comparisons)" for f, name in FAMILIES.items())
    n_seeds = len(p.grid.seeds)
    exact_floor = 2 / 2 ** n_seeds
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
        f"- Unit: the seed ({n_seeds} seeds: {', '.join(map(str, p.grid.seeds))}); arms share seeds, so tests are "
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
    sections = {"coef": "## Final gold at matched coefficient",
                "kl": "## Gold at matched KL", "frontier": "## Frontier (normalised gold-vs-KL-budget area)"}
    for fam, title in sections.items():
        L += [title, ""]
        if fam == "kl":
            reach = res.reach.copy()
            reach["max KL reached, median over runs (nats)"] = reach.iloc[:, -1].map(_f)
            L += ["Runs that reached each budget (of all runs of the arm, over all coefficients):", "",
                  _md(reach.astype(str)), ""]
        L += [comparison_table(c[c.family == fam]), ""]
    ct = res.cell_table
    L += ["## Factorial view: placement × estimator × coefficient", "",
          "Mean ± SD over seeds per cell.", "",
          _md(pd.DataFrame({
              "arm": ct.arm, "target": ct.target, "placement": ct.placement, "estimator": ct.estimator,
              "coef": ct.coef.map(lambda x: f"{x:g}"), "n": ct.n.astype(str),
              a.metric: [_pm(m, s) for m, s in zip(ct[f"{a.metric}_mean"], ct[f"{a.metric}_sd"])],
              "final KL (nats)": [_pm(m, s) for m, s in zip(ct.final_kl_mean, ct.final_kl_sd)],
              "frontier": [_pm(m, s) for m, s in zip(ct.frontier_mean, ct.frontier_sd)],
          })), ""]
    for label, (formula, table) in res.anova.items():
        t = table.reset_index().rename(columns={"index": "term"})
        t = pd.DataFrame({"term": t.term, "sum sq": t.sum_sq.map(lambda x: f"{x:.4g}"),
                          "df": t.df.map(lambda x: f"{x:g}"), "F": t.F.map(lambda x: _f(x, 2)),
                          "p": t["PR(>F)"].map(_p)})
        L += [f"**{label}**: type-II ANOVA, `{formula}` (seed as a block; descriptive, not Holm-corrected)", "",
              _md(t), ""]
    L += ["## Plots", ""]
    for title, name in images.items():
        L += [f"### {title}", "", f"![{title}]({name})", ""]
    perm_disagree = int(((c.p < a.alpha) != (c.p_perm < a.alpha))[np.isfinite(c.p_perm)].sum())
    L += ["## Notes", "",
          f"- The permutation test and the t-test disagree about p < {a.alpha:g} (both unadjusted) in "
          f"{perm_disagree} of {len(c)} comparisons; with few seeds the exact test cannot reach small p-values.",
          "- CIs are unadjusted; verdicts use Holm-adjusted p-values, so a CI may exclude 0 without a verdict of "
          "difference.",
          "- At matched KL an arm's value per seed averages the coefficients whose runs reached the budget, so two "
          "arms may average different coefficients at a high budget (see the reach table); the frontier summary "
          "uses every run.",
          "- The ANOVAs treat the coefficient as a factor within a placement; a coefficient means different things "
          "in different placements, so they are not compared across placements.",
          "- All tables: reports/comparisons.csv (every comparison) and reports/runs.csv (every run).", ""]
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
    return _clean({
        "headline": res.headline, "n_runs": len(res.runs), "n_seeds": len(res.params.grid.seeds),
        "metric": a.metric, "reference_arm": a.reference_arm, "margin": a.margin, "alpha": a.alpha, "power": a.power,
        "verdicts": {f: {"n": int((c.family == f).sum()), **{k.replace(" ", "_"): v for k, v in
                                                           _counts(c[c.family == f]).items()}} for f in FAMILIES},
        a.metric: {f"{r.arm}@{r.coef:g}" if r.arm != BASELINE else r.arm: r[f"{a.metric}_mean"]
                   for _, r in res.cell_table.iterrows()},
        "diff": {f"{r.family}/{r.arm}" + ("" if r.level is None or not np.isfinite(r.level) else f"@{r.level:g}"):
                 r["diff"] for _, r in c.iterrows()},
    })


def write_outputs(res: Results, out_dir: Path | str) -> list[Path]:
    """Writes OUTPUTS into ``out_dir`` (created if needed): report.md, stats.json, comparisons.csv, runs.csv and
    the three PNGs under figures/; returns their paths in OUTPUTS order. report.md is written last."""
    from ablations import plots  # matplotlib only when writing

    out = Path(out_dir)
    (out / FIGURES).mkdir(parents=True, exist_ok=True)
    p, a = res.params, res.params.analysis
    arms = list(p.grid.arms)
    fig = out / FIGURES
    images = {
        "Gold reward vs KL, every run": plots.gold_vs_kl(res.runs, res.evals, arms, p.grid.coefs, a.kl_budgets,
                                                         fig / "gold_vs_kl.png"),
        "Learning curves": plots.learning_curves(res.evals, arms, p.grid.coefs, fig / "learning_curves.png"),
        "Differences to the reference arm (forest plot)": plots.forest(res.comparisons, FAMILIES, a.margin,
                                                                       a.reference_arm, fig / "forest.png"),
    }
    images = {k: v.relative_to(out).as_posix() for k, v in images.items()}
    res.comparisons.to_csv(out / "comparisons.csv", index=False)
    res.runs.to_csv(out / "runs.csv", index=False)
    (out / "stats.json").write_text(json.dumps(stats_summary(res), indent=2) + "\n")
    (out / "report.md").write_text(render_report(res, images))
    return [out / name for name in OUTPUTS]


def run(params: Params, out_dir: Path | str, root: Path | str = ".") -> list[Path]:
    """analyse() then write_outputs(): the whole analysis of the runs under ``root`` into ``out_dir``."""
    return write_outputs(analyse(params, root), out_dir)
