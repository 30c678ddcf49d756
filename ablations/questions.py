"""The exploratory families of one task: every comparison the evaluation runs allow, beyond the primary ones.

The headline is carried by the pre-registered primary comparisons alone (ablations/primary.py); the families here
are exploratory: Holm within each family, nothing across families, and no claim in the headline rests on them.

Q1 Restraint (fixed-coefficient runs): does a variant keep the policy near the reference at all? Per instance the
   log ratio of final exact KL to the no-KL run's, one-sided against the minimum meaningful reduction
   (``min_log_kl_reduction``): "restrains" if the mean log ratio is shown below -delta, "does not restrain" if shown
   above it. One family per coefficient.
Q2 Matched coefficient: final metric of each arm against the reference arm and, within each estimator that has both,
   the loss placement against the reward placement at the same coefficient. One family per (metric, coefficient).
Q3 Matched KL by construction: the same comparisons among runs steered to the same KL target, every run counted
   (intention to treat: a run that misses its target keeps its final value); hit rates per arm with exact CIs, and an
   arm below ``min_hit_rate`` is "not steerable" at that target. One family per (metric, target).

Every family carries the no-KL positive control (no KL against the reference arm; Q1: the reference arm
restrains), tested at alpha/m (m = the family's size) and kept out of the family's Holm set. Values are instance
means over nested PPO seeds; comparisons are paired by instance (ablations/stats.py). ``tp`` is the task's judged
protocol (config.Judged: the calibrated margins filled in).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from ablations import stats as S
from ablations.config import AnalysisParams, Judged
from ablations.load import BASELINE, spec_of

PC_ROLE = "positive control"


# ---------------------------------------------------------------- per-instance values


def unit_table(runs: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """(kind, arm, level) -> instance x numeric columns, each the mean over the instance's PPO seeds (the unit of
    analysis). The baseline's level is None."""
    num = runs.select_dtypes("number").drop(columns=["instance", "seed", "level"], errors="ignore").columns
    means = runs.groupby(["kind", "arm", "level", "instance"], dropna=False, sort=False)[list(num)].mean()
    out = {}
    for (kind, arm, level), g in means.groupby(level=[0, 1, 2], dropna=False, sort=False):
        out[(kind, arm, None if pd.isna(level) else float(level))] = g.droplevel([0, 1, 2])
    return out


def unit_values(units: dict, kind: str, arm: str, level: float | None, column: str) -> pd.Series:
    """One value per instance (the mean over its PPO seeds) of ``column`` for ``arm``'s runs of ``kind`` at
    ``level`` (None for the baseline); empty when there are none."""
    t = units.get((kind, arm, None if level is None else float(level)))
    return t[column] if t is not None and column in t else pd.Series(dtype=float)


def arm_specs(runs: pd.DataFrame, kind: str) -> dict[str, dict[str, str]]:
    """arm -> spec (string fields of summary.json) for the KL arms of ``kind``, in order of first appearance."""
    sel = runs[(runs.kind == kind) & (runs.arm != BASELINE)].drop_duplicates("arm")
    return {r["arm"]: spec_of(r) for r in sel.to_dict("records")}


def comparison_pairs(specs: dict[str, dict[str, str]], reference: str) -> list[tuple[str, str, str]]:
    """(arm, other, role) of a family: for each pair of arms identical except placement reward -> loss, the loss arm
    against the reward arm (role "placement (<estimator>)"), then every arm against ``reference`` ("vs reference");
    a pair already present is not repeated."""
    out, seen = [], set()
    for a, sa in specs.items():
        for b, sb in specs.items():
            rest = lambda s: {k: v for k, v in s.items() if k != "placement"}
            if sa.get("placement") == "loss" and sb.get("placement") == "reward" and rest(sa) == rest(sb):
                out.append((a, b, f"placement ({sa.get('estimator', '?')})"))
                seen.add(frozenset((a, b)))
    for a in specs:
        if a != reference and frozenset((a, reference)) not in seen and reference in specs:
            out.append((a, reference, "vs reference"))
    return out


# ---------------------------------------------------------------- one comparison, one family


def compare(a: pd.Series, b: pd.Series, *, margin: float, alpha: float, permutation: bool = True) -> dict:
    """Paired comparison of two per-instance series on their common instances (stats.paired): means, difference,
    SD, 95% and 90% CIs, t, two-sided p, TOST p and the exact sign-flip p. NaN statistics below 2 instances."""
    a, b = a.dropna(), b.dropna()
    idx = a.index.intersection(b.index)
    av, bv = a.loc[idx].to_numpy(float), b.loc[idx].to_numpy(float)
    d = av - bv
    nan = math.nan
    row = dict(n=len(d), mean_arm=float(av.mean()) if len(d) else nan, mean_other=float(bv.mean()) if len(d) else nan,
               margin=margin, diff=float(d.mean()) if len(d) else nan)  # fmt: skip
    if len(d) < 2:
        return {**row, **dict.fromkeys(("sd", "ci95_lo", "ci95_hi", "ci90_lo", "ci90_hi", "t", "p", "p_tost"), nan),
                "df": nan, "p_perm": nan}  # fmt: skip
    r = S.paired(d, margin=margin, alpha=alpha)
    return {
        **row,
        "sd": float(r["sd"]),
        "ci95_lo": float(r["ci95"][0]),
        "ci95_hi": float(r["ci95"][1]),
        "ci90_lo": float(r["ci90"][0]),
        "ci90_hi": float(r["ci90"][1]),
        "t": float(r["t"]),
        "df": float(r["df"]),
        "p": float(r["p"]),
        "p_tost": float(r["p_tost"]),
        "p_perm": S.signflip_p(d) if permutation else math.nan,
    }


def decide_family(rows: list[dict], *, alpha: float, power: float, plan: bool = True) -> list[dict]:
    """Holm within the family (difference and TOST p separately), verdicts, and for inconclusive comparisons the
    instances needed at the Holm level alpha/m to show the OBSERVED difference and to show equivalence."""
    m = len(rows)
    ph, eh = S.holm([r["p"] for r in rows]), S.holm([r["p_tost"] for r in rows])
    out = []
    for r, p_h, e_h in zip(rows, ph, eh):
        v = S.verdict(p_h, e_h, alpha)
        within = bool(np.isfinite(e_h) and e_h < alpha)
        need_d = need_e = math.nan
        if v == S.INCONCLUSIVE and plan:
            need_d = S.instances_needed_difference(r["diff"], r["sd"], alpha=alpha / m, power=power)
            need_e = S.instances_needed_equivalence(r["diff"], r["sd"], r["margin"], alpha=alpha / m, power=power)
        half = stats.t.ppf(1 - alpha / m, r["n"] - 1) * r["sd"] / math.sqrt(r["n"]) if r["n"] >= 2 else math.nan
        out.append(
            {
                **r,
                "m": m,
                "p_holm": float(p_h),
                "p_tost_holm": float(e_h),
                "verdict": v,
                "within_margin": within,
                "material": v == S.DIFFERENCE and not within,
                "fw_lo": r["diff"] - half,  # the (1 - 2 alpha/m) CI: inside +-margin it shows equivalence at
                "fw_hi": r["diff"] + half,  # the strictest Holm step
                "n_needed_diff": need_d,
                "n_needed_equiv": need_e,
            }
        )
    return out


def family(
    *,
    task: str,
    question: str,
    metric: str,
    level: float | None,
    name: str,
    pairs: list[tuple[str, str, str]],
    values,
    margin: float,
    proto: AnalysisParams,
    permutation: bool,
) -> tuple[list[dict], dict]:
    """The comparisons of one family (``values(arm)`` gives an arm's per-instance series; "none" the baseline's),
    decided together, and the family record with its positive control (no KL vs the reference arm)."""
    base = dict(task=task, question=question, metric=metric, family=name, level=level, alpha=proto.alpha)
    rows = []
    for a, b, role in pairs:
        c = compare(values(a), values(b), margin=margin, alpha=proto.alpha, permutation=permutation)
        rows.append({**base, "label": f"{a} − {b}", "role": role, "arm": a, "other": b, "in_family": True, **c})
    rows = decide_family(rows, alpha=proto.alpha, power=proto.power, plan=permutation)
    m = max(1, len(rows))
    ref = proto.reference_arm
    pc = compare(values(BASELINE), values(ref), margin=margin, alpha=proto.alpha, permutation=permutation)
    passed = bool(np.isfinite(pc["p"]) and pc["p"] < proto.alpha / m)
    pc_row = {**base, "label": f"{BASELINE} − {ref}", "role": PC_ROLE, "arm": BASELINE, "other": ref,
              "in_family": False, **pc, "m": m, "verdict": S.DIFFERENCE if passed else "not detected"}  # fmt: skip
    n = pc["n"]
    fam = {
        **{k: base[k] for k in ("task", "question", "metric", "family", "level")},
        "m": len(rows),
        "n": n,
        "pc_diff": pc["diff"],
        "pc_p": pc["p"],
        "pc_threshold": proto.alpha / m,
        "pc_pass": passed,
        "floor": S.signflip_floor(n) if n else math.nan,
        "exact_reachable": bool(n and S.signflip_floor(n) < proto.alpha / m),
    }
    return [*rows, pc_row], fam


# ---------------------------------------------------------------- Q1 restraint


def restraint(runs: pd.DataFrame, units: dict, task: str, tp: Judged, proto: AnalysisParams, permutation=True):
    """Q1 rows (one per arm and coefficient) and family records (one per coefficient). ``units`` (unit_table) must
    hold ``log_kl``, the log of each run's final exact KL (averaged over seeds: a geometric mean)."""
    none = unit_values(units, "baseline", BASELINE, None, "log_kl")
    delta, alpha = tp.margins["log_kl"], proto.alpha
    rows, fams = [], []
    for c in sorted(runs[runs.kind == "fixed"].level.unique()):
        fam_rows = []
        for arm in arm_specs(runs[np.isclose(runs.level.astype(float), c)], "fixed"):
            both = pd.concat([unit_values(units, "fixed", arm, c, "log_kl").rename("a"), none.rename("b")], axis=1)
            d = (both.a - both.b).dropna().to_numpy()
            p_r, p_n = (float(x) for x in S.shifted_one_sided(d, shift=delta)) if len(d) >= 2 else (math.nan,) * 2
            lo, hi = (float(x) for x in S.ci(d, 1 - 2 * alpha)) if len(d) >= 2 else (math.nan,) * 2
            fam_rows.append(
                dict(task=task, question="Q1", family=f"Q1 @ coef {c:g}", level=float(c), arm=arm, n=len(d),
                     kl_arm=float(np.exp(both.a.mean())), kl_none=float(np.exp(both.b.mean())),
                     log_ratio=float(d.mean()) if len(d) else math.nan, ci90_lo=lo, ci90_hi=hi, delta=delta,
                     p_restrain=p_r, p_no_restraint=p_n, alpha=alpha,
                     p_perm=S.signflip_p(d, alternative="less", shift=delta) if permutation else math.nan)
            )  # fmt: skip
        ph, nh = S.holm([r["p_restrain"] for r in fam_rows]), S.holm([r["p_no_restraint"] for r in fam_rows])
        m = max(1, len(fam_rows))
        for r, a, b in zip(fam_rows, ph, nh):
            v = S.RESTRAINS if a < alpha else S.NO_RESTRAINT if b < alpha else S.INCONCLUSIVE
            r.update(m=m, p_restrain_holm=float(a), p_no_restraint_holm=float(b), verdict=v)
        ref = next((r for r in fam_rows if r["arm"] == proto.reference_arm), None)
        n = ref["n"] if ref else 0
        fams.append(
            dict(task=task, question="Q1", metric="kl", family=f"Q1 @ coef {c:g}", level=float(c), m=len(fam_rows),
                 n=n, pc_diff=ref["log_ratio"] if ref else math.nan, pc_p=ref["p_restrain"] if ref else math.nan,
                 pc_threshold=alpha / m, pc_pass=bool(ref and ref["p_restrain"] < alpha / m),
                 floor=S.signflip_floor(n, two_sided=False) if n else math.nan,
                 exact_reachable=bool(n and S.signflip_floor(n, two_sided=False) < alpha / m))
        )  # fmt: skip
        rows += fam_rows
    return rows, fams


def collapse_table(runs: pd.DataFrame, tp: Judged, level: float) -> pd.DataFrame:
    """Per cell (kind, arm, level): runs whose final gold is below their SFT gold by more than ``collapse_drop``,
    with the exact (Clopper-Pearson) CI at ``level``."""
    collapsed = runs.final_gold < runs.sft_gold - tp.collapse_drop
    out = []
    for (kind, arm, lvl), g in runs.assign(c=collapsed).groupby(["kind", "arm", "level"], sort=False, dropna=False):
        lo, hi = S.clopper_pearson(int(g.c.sum()), len(g), level)
        out.append(dict(kind=kind, arm=arm, level=lvl, runs=len(g), collapsed=int(g.c.sum()),
                        rate=float(g.c.mean()), ci_lo=lo, ci_hi=hi))  # fmt: skip
    return pd.DataFrame(out)


# ---------------------------------------------------------------- Q3 steering


def steering_table(runs: pd.DataFrame, tp: Judged, proto: AnalysisParams) -> pd.DataFrame:
    """Per matched cell (arm, target): runs that hit the target (final exact KL within ``kl_tolerance`` of it,
    relative), the hit rate with its exact CI, and whether the arm is steerable there (rate >= min_hit_rate).
    Misses are counted here and stay in the gold comparison."""
    m = runs[runs.kind == "matched"]
    out = []
    for (arm, target), g in m.groupby(["arm", "level"], sort=False):
        hit = (g.final_kl / target - 1).abs() <= tp.kl_tolerance
        lo, hi = S.clopper_pearson(int(hit.sum()), len(g), 1 - proto.alpha)
        out.append(dict(arm=arm, target=float(target), runs=len(g), hits=int(hit.sum()), rate=float(hit.mean()),
                        ci_lo=lo, ci_hi=hi, steerable=bool(hit.mean() >= proto.min_hit_rate),
                        kl_median=float(g.final_kl.median()), kl_min=float(g.final_kl.min()),
                        kl_max=float(g.final_kl.max())))  # fmt: skip
    return pd.DataFrame(out)


# ---------------------------------------------------------------- all four questions of one task


def _getter(units: dict, kind: str, level: float | None, col: str):
    """arm -> its per-instance series of ``col``: the baseline's for "none", else the arm's runs of ``kind`` at
    ``level``."""

    def get(arm: str) -> pd.Series:
        if arm == BASELINE:
            return unit_values(units, "baseline", BASELINE, None, col)
        return unit_values(units, kind, arm, level, col)

    return get


def answer_questions(runs: pd.DataFrame, task: str, proto: AnalysisParams, tp: Judged, permutation=True) -> dict:
    """The exploratory families Q1-Q3 on ``runs`` (one task's evaluation runs). Returns DataFrames: ``comparisons``
    (Q2, Q3, with the positive-control rows), ``restraint`` (Q1), ``families`` (one record per family with at least
    one comparison, with its positive control and exact-test floor), ``steering`` (Q3 hit rates)."""
    ref = proto.reference_arm
    runs = runs.assign(log_kl=np.log(runs.final_kl.where(runs.final_kl > 0)))
    units = unit_table(runs)
    q1, fams = restraint(runs, units, task, tp, proto, permutation)
    comps = []
    for metric in tp.metrics:
        col, margin = f"final_{metric}", tp.margins[metric]
        common = dict(task=task, metric=metric, margin=margin, proto=proto, permutation=permutation)
        for kind, q, word in (("fixed", "Q2", "coef"), ("matched", "Q3", "KL target")):
            for lvl in sorted(runs[runs.kind == kind].level.unique()):
                at = runs[(runs.kind == kind) & np.isclose(runs.level.astype(float), lvl)]
                pairs = comparison_pairs(arm_specs(at, kind), ref)
                if not pairs:
                    continue
                rows, fam = family(
                    question=q,
                    level=float(lvl),
                    name=f"{q} {metric} @ {word} {lvl:g}",
                    pairs=pairs,
                    values=_getter(units, kind, lvl, col),
                    **common,
                )
                comps += rows
                fams.append(fam)
    return {
        "comparisons": pd.DataFrame(comps),
        "restraint": pd.DataFrame(q1),
        "families": pd.DataFrame(fams),
        "steering": steering_table(runs, tp, proto),
    }
