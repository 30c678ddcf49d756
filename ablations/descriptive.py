"""Descriptive and secondary analyses of one task: cell summaries with a bimodality flag, the crossed factorial
placement x estimator, and the secondary outcomes (response length, share of empty responses).

Factorial. The crossed set is the arms that share every spec field with the reference arm except placement and
estimator, with placement reward or loss, restricted to estimators that have both placements (if fewer than two
estimators qualify, placement is not crossed with estimator and only the simple placement effects of Q2-Q4 exist).
Each effect is a within-instance contrast of the cell values Y[i, p, e]:
    placement     mean_e (Y[i, loss, e] - Y[i, reward, e])                        (1 component)
    estimator     M[i, e] - M[i, e0], M = the mean over the two placements        (E - 1 components)
    interaction   D[i, e] - D[i, e0], D = Y[i, loss, .] - Y[i, reward, .]         (E - 1 components)
tested by the studentized sign-flip test over instances (stats.signflip_vector_test). Sign flips of whole
instances need no equal variances across cells and no normality, so a bimodal (collapsing) cell cannot make the
test invalid; it can still dominate an effect, which is why every cell carries a bimodality flag and the report
names the flagged cells next to each effect. Descriptive: not part of any question's family.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ablations import stats as S
from ablations.config import AnalysisParams
from ablations.load import BASELINE
from ablations.questions import arm_specs, unit_table, unit_values

FACTORS = ("placement", "estimator")


def cell_table(runs: pd.DataFrame, task: str, proto: AnalysisParams) -> pd.DataFrame:
    """Per cell (kind, arm, level): runs, instances, mean and SD over runs of each compared metric and of final KL,
    length and empty share, and the bimodality flag of final gold over runs: the cell mixes collapsed and
    non-collapsed runs (the pre-registered collapse rule, which sees two modes even in 6 runs), or the
    Engelman-Hartigan test rejects one normal sample at ``bimodality_alpha``."""
    tp = proto.tasks[task]
    cols = [f"final_{m}" for m in [*tp.margins, "kl", "length", "empty"] if f"final_{m}" in runs]
    collapsed = runs.final_gold < runs.sft_gold - tp.collapse_drop
    out = []
    for (kind, arm, level), g in runs.assign(c=collapsed).groupby(["kind", "arm", "level"], sort=False, dropna=False):
        row = dict(kind=kind, arm=arm, level=level, runs=len(g), instances=g.instance.nunique())
        for c in cols:
            row[f"{c}_mean"], row[f"{c}_sd"] = float(g[c].mean()), float(g[c].std())
        p = S.bimodality_p(g.final_gold.to_numpy())
        mixed, split = 0 < g.c.sum() < len(g), bool(np.isfinite(p) and p < proto.bimodality_alpha)
        why = [w for w, flag in (("mixed collapse", mixed), ("two groups", split)) if flag]
        row.update(bimodality_p=p, bimodal=bool(why), bimodal_why=", ".join(why))
        out.append(row)
    return pd.DataFrame(out)


def crossed_set(runs: pd.DataFrame, reference: str) -> tuple[dict[str, dict[str, str]], str]:
    """The crossed arms as estimator -> {placement: arm} (estimators with both placements only), and a sentence
    saying what is crossed or why nothing is."""
    specs = arm_specs(runs, "fixed") or arm_specs(runs, "matched")
    if reference not in specs:
        return {}, f"the reference arm {reference} has no runs"
    rest = lambda s: {k: v for k, v in s.items() if k not in FACTORS}
    grid: dict[str, dict[str, str]] = {}
    for arm, s in specs.items():
        if rest(s) == rest(specs[reference]) and s.get("placement") in ("reward", "loss"):
            grid.setdefault(s.get("estimator", "?"), {})[s["placement"]] = arm
    full = {e: v for e, v in grid.items() if len(v) == 2}
    if len(full) < 2:
        return full, (
            f"placement is not crossed with estimator: only {', '.join(full) or 'no estimator'} has both "
            f"placements among the arms like {reference}"
        )
    return full, f"placement {{reward, loss}} × estimator {{{', '.join(full)}}} among the arms like {reference}"


def _effects(y: dict[tuple[str, str], pd.Series], estimators: list[str]) -> dict[str, np.ndarray]:
    """Per-instance contrast matrices of the three factorial effects from cell series y[(placement, estimator)]."""
    df = pd.concat({k: v for k, v in y.items()}, axis=1).dropna()
    rew = np.column_stack([df[("reward", e)] for e in estimators])
    los = np.column_stack([df[("loss", e)] for e in estimators])
    d, m = los - rew, (los + rew) / 2
    return {
        "placement": d.mean(axis=1, keepdims=True),
        "estimator": m[:, 1:] - m[:, :1],
        "placement × estimator": d[:, 1:] - d[:, :1],
    }


def factorial(runs: pd.DataFrame, cells: pd.DataFrame, proto: AnalysisParams) -> pd.DataFrame:
    """Sign-flip tests of the factorial effects on final gold at every coefficient (fixed runs) and every KL target
    (matched runs) where the crossed set ran; bimodal crossed cells are named on each row."""
    grid, _ = crossed_set(runs, proto.reference_arm)
    if len(grid) < 2:
        return pd.DataFrame()
    est = list(grid)
    units = unit_table(runs)
    arms = {a for v in grid.values() for a in v.values()}
    levels = [("fixed", lv) for lv in sorted(runs[runs.kind == "fixed"].level.unique())]
    levels += [("matched", lv) for lv in sorted(runs[runs.kind == "matched"].level.unique())]
    out = []
    for kind, lv in levels:
        get = lambda arm, k=kind, v=lv: unit_values(units, k, arm, v, "final_gold")
        y = {(p, e): get(grid[e][p]) for e in est for p in ("reward", "loss")}
        if any(s.empty for s in y.values()):
            continue
        flagged = cells[(cells.kind == kind) & cells.arm.isin(arms) & cells.bimodal]
        flagged = flagged[np.isclose(flagged.level.astype(float), lv)] if lv is not None else flagged.iloc[:0]
        for name, c in _effects(y, est).items():
            stat, p, exact = S.signflip_vector_test(c)
            out.append(dict(kind=kind, level=lv, effect=name, components=c.shape[1], n=len(c),
                            mean=float(c.mean()) if c.shape[1] == 1 else np.nan, statistic=stat, p=p, exact=exact,
                            floor=S.signflip_floor(len(c)), bimodal_cells=", ".join(flagged.arm)))  # fmt: skip
    return pd.DataFrame(out)


def secondary(runs: pd.DataFrame, proto: AnalysisParams) -> pd.DataFrame:
    """Secondary outcomes per arm and level: final response length and share of empty responses (instance means),
    each arm's difference to the reference arm at the same level with a paired 95% CI (descriptive, no family)."""
    units = unit_table(runs)
    ref, out = proto.reference_arm, []
    for (kind, arm, lv), t in units.items():
        ref_t = units.get((kind, ref, lv)) if kind != "baseline" else None
        for col in ("final_length", "final_empty"):
            if col not in t:
                continue
            row = dict(kind=kind, arm=arm, level=lv, outcome=col.removeprefix("final_"), mean=float(t[col].mean()))
            if ref_t is not None and arm != ref and arm != BASELINE:
                d = pd.concat([t[col], ref_t[col]], axis=1).dropna()
                diff = (d.iloc[:, 0] - d.iloc[:, 1]).to_numpy()
                lo, hi = S.ci(diff, 1 - proto.alpha)
                row.update(ref_mean=float(d.iloc[:, 1].mean()), diff=float(diff.mean()), ci_lo=float(lo),
                           ci_hi=float(hi))  # fmt: skip
            out.append(row)
    return pd.DataFrame(out)
