"""Analysis of the KL-placement grid: does it matter where the KL penalty goes?

Reads every cell of the current params.yaml grid from its run directory (summary.json, evals.csv; never MLflow,
and never a stale directory of a cell no longer in the grid), applies the protocol of ablations/stats.py
(params.yaml ``analysis``) in three families, and writes the report (words and tables in ablations/report.py):

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
from ablations.report import FAMILIES, budget_column, render_report, stats_summary, write_answer

SUMMARY_KEYS = ("arm", "coef", "instance", "final_gold", "final_kl")
EVAL_COLUMNS = ("iteration", "gold", "kl")
FIGURES = "figures"  # sub-folder of the output folder holding the PNGs (a DVC out of its own)
OUTPUTS = (
    "stats.json",
    "comparisons.csv",
    "runs.csv",
    f"{FIGURES}/gold_vs_kl.png",
    f"{FIGURES}/learning_curves.png",
    f"{FIGURES}/forest.png",
    "report.md",
)  # relative to the output folder; report.md last


class MissingResultsError(FileNotFoundError):
    """A cell of the grid has no (or unreadable, or someone else's) results; the message names its stage."""


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
    if (summary["arm"], int(summary["instance"])) != (cell.arm, cell.instance) or (
        cell.arm != BASELINE and not math.isclose(float(summary["coef"]), cell.coef)
    ):
        raise MissingResultsError(
            f"stage {cell.stage}: {summary_path} holds arm={summary['arm']} "
            f"coef={summary['coef']} instance={summary['instance']}; rerun the stage"
        )
    if evals.empty:
        raise MissingResultsError(f"stage {cell.stage}: {evals_path} has no rows")
    return summary, evals.sort_values("iteration").reset_index(drop=True)


def load_runs(params: Params, root: Path | str = ".") -> tuple[pd.DataFrame, pd.DataFrame]:
    """Reads summary.json and evals.csv of every cell of ``cells(params)`` under ``root`` (only those: stale
    directories are never listed). Returns (runs, evals). Raises MissingResultsError naming every missing stage."""
    root = Path(root)
    rows, evals, problems = [], [], []
    # Interim (until protocol v2): one task, the fixed-coefficient cells and the baseline; the unit ("seed" below)
    # is the task instance, the only PPO seed being grid.seeds[0].
    task = next(iter(params.tasks()))
    for cell in [c for c in cells(params) if c.task == task and c.kind != "matched" and c.seed == params.grid.seeds[0]]:
        try:
            summary, ev = _load_cell(cell, root)
        except MissingResultsError as e:
            problems.append(str(e))
            continue
        spec = cell.kl
        rows.append(
            {
                **summary,
                "arm": cell.arm,
                "coef": cell.coef or 0.0,
                "seed": cell.instance,
                "stage": cell.stage,
                "target": spec.target,
                "placement": spec.placement,
                "estimator": spec.estimator or "-",
            }
        )
        evals.append(ev.assign(arm=cell.arm, coef=cell.coef or 0.0, seed=cell.instance))
    if problems:
        shown = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise MissingResultsError(
            f"analysis needs every cell of the params.yaml grid; {len(problems)} stage(s) "
            f"have no usable results (run `dvc repro` for them):\n  {shown}"
        )
    return pd.DataFrame(rows), pd.concat(evals, ignore_index=True)


def add_budget_metrics(runs: pd.DataFrame, evals: pd.DataFrame, budgets: list[float]) -> pd.DataFrame:
    """Adds to each run gold at every KL budget (stats.gold_at_kl, first crossing), ``max_kl`` (largest eval KL)
    and ``frontier`` (stats.budget_curve_auc up to the largest budget), from its eval trajectory in training order."""
    runs = runs.copy()
    by_run = {k: g for k, g in evals.groupby(["arm", "coef", "seed"], sort=False)}
    for b in budgets:
        runs[budget_column(b)] = [
            S.gold_at_kl(by_run[k].kl, by_run[k].gold, b) for k in zip(runs.arm, runs.coef, runs.seed)
        ]
    runs["max_kl"] = [float(by_run[k].kl.max()) for k in zip(runs.arm, runs.coef, runs.seed)]
    runs["frontier"] = [
        S.budget_curve_auc(by_run[k].kl, by_run[k].gold, max(budgets)) for k in zip(runs.arm, runs.coef, runs.seed)
    ]
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
            fams["coef"].append(
                S.compare(
                    per_seed(runs, arm, a.metric, coef),
                    per_seed(runs, ref, a.metric, coef),
                    family="coef",
                    label=f"{arm} @ coef {coef:g}",
                    arm_name=arm,
                    level=coef,
                    **kw,
                )
            )
    for b in a.kl_budgets:
        col = budget_column(b)
        for arm in others:
            fams["kl"].append(
                S.compare(
                    per_seed(runs, arm, col),
                    per_seed(runs, ref, col),
                    family="kl",
                    label=f"{arm} @ KL {b:g} nats",
                    arm_name=arm,
                    level=b,
                    **kw,
                )
            )
    for arm in others:
        fams["frontier"].append(
            S.compare(
                per_seed(runs, arm, "frontier"),
                per_seed(runs, ref, "frontier"),
                family="frontier",
                label=f"{arm} frontier",
                arm_name=arm,
                **kw,
            )
        )
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
    t = (
        g[metric]
        .agg(["count", "mean", "std"])
        .rename(columns={"count": "n", "mean": f"{metric}_mean", "std": f"{metric}_sd"})
    )
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


# ---------------------------------------------------------------- putting it together


def analyse(params: Params, root: Path | str = ".") -> Results:
    """Loads the grid's runs under ``root`` and computes every table of the report (no files written)."""
    a = params.analysis
    runs, evals = load_runs(params, root)
    runs = add_budget_metrics(runs, evals, a.kl_budgets)
    comparisons = compare_all(params, runs)
    res = Results(
        params=params,
        runs=runs,
        evals=evals,
        comparisons=comparisons,
        reach=reach_table(params, runs),
        cell_table=cell_table(runs, a.metric),
        anova=factorial_anova(runs, a.metric),
    )
    res.answer, res.headline = write_answer(params, comparisons, runs)
    return res


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
        "Gold reward vs KL, every run": plots.gold_vs_kl(
            res.runs, res.evals, arms, p.grid.coefs, a.kl_budgets, fig / "gold_vs_kl.png"
        ),
        "Learning curves": plots.learning_curves(res.evals, arms, p.grid.coefs, fig / "learning_curves.png"),
        "Differences to the reference arm (forest plot)": plots.forest(
            res.comparisons, FAMILIES, a.margin, a.reference_arm, fig / "forest.png"
        ),
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
