"""Calibration: everything the protocol tunes is fixed on the calibration instances, before any evaluation cell runs.

The stage ``<task>_calibrate`` (pipelines/calibrate.py) reads only the calibration cells (their own task seeds,
disjoint from the evaluation instances: ablations/config.py refuses an overlap) and writes protocol/<task>.json,
the file every evaluation design cell depends on (dvc.yaml). Its rules are written in params.yaml
(``<task>.calibration``) before the calibration runs; given the cells, every value is a deterministic function:

* gain = mean over calibration instances of (G_i - SFT gold_i), G_i the no-KL run's ``gain`` gold: its peak over
  the held-out evaluations (evaluated every ``ppo.eval_every`` iterations) or its final gold. Instances average
  their PPO seeds first.
* margin(m) = ``margin_fraction`` x gain, for every compared gold metric m (the accuracy metrics of a task share
  units).
* the no-KL contrast of the reference arm at coefficient β: c(β) = no-KL mean final gold - the reference arm's at β.
  The penalty ACTS at β when |c(β)| >= ``acts`` x margin: removing it changes gold by several margins there, so
  "placement does not matter" could not be the trivial "the penalty does nothing". ``coef`` = the acting
  coefficient with the highest mean final gold (ties: the smaller); if none acts, the coefficient with the largest
  |c| (``acts_on_calibration`` false: every equivalence at it will read "inert").
* best[arm] = the calibration coefficient with the highest mean final gold (ties: the smaller), for every calibration
  arm: the ``tuned`` role (each camp at its own best, the practice comparison).
* the margin-sized positive control: the coefficient ``control_coef`` where the reference arm's calibration gold
  curve, linear between adjacent coefficients in log β, differs from its gold at ``coef`` by exactly one margin;
  searched first on the stronger side (β > coef), then the weaker; if neither side reaches one margin inside the
  calibrated range, the calibration coefficient whose difference is closest to one margin (``control_interpolated``
  false). Its expected effect (gold at ``coef`` minus at ``control_coef``, log KL likewise, by the same
  interpolation) and sign are recorded: the evaluation must detect it in that direction.
* the log-KL margin = ``log_kl_fraction`` x |no-KL mean log final KL - the reference arm's at ``coef``| (a share of
  what the penalty does to log KL where the questions are asked).
* the frontier's KL levels = each of ``levels`` x the median over the no-KL runs of their final exact KL: between
  the SFT policy (KL 0) and where the no-KL runs end, so the no-KL trajectory crosses each.
* the no-KL control's expected direction per metric (gold, log KL) at ``coef``: sign of (no KL - reference arm).

Pure functions of DataFrames (ablations/load.py load_runs output): no I/O here.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from ablations.config import CalibrationParams


def _instance_mean(df: pd.DataFrame, col: str) -> pd.Series:
    """Per instance: the mean of ``col`` over the instance's PPO seeds."""
    return df.groupby("instance")[col].mean()


def no_kl_points(runs: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """One row per calibration no-KL run: instance, seed, SFT gold, final gold and exact KL, and the peak (the first
    evaluation with the run's highest gold) with the exact KL there."""
    base = runs[runs.kind == "calibration_baseline"]
    rows = []
    for r in base.itertuples():
        ev = evals[(evals.kind == "calibration_baseline") & (evals.instance == r.instance) & (evals.seed == r.seed)]
        ev = ev.sort_values("iteration")
        k = int(np.argmax(ev.gold.to_numpy()))
        rows.append(dict(instance=r.instance, seed=r.seed, sft_gold=r.sft_gold, final_gold=r.final_gold,
                         final_kl=r.final_kl, peak_gold=float(ev.gold.iloc[k]), peak_kl=float(ev.kl.iloc[k]),
                         peak_iteration=int(ev.iteration.iloc[k])))  # fmt: skip
    return pd.DataFrame(rows)


def coef_table(runs: pd.DataFrame, column: str) -> pd.DataFrame:
    """arm x coefficient: the mean over calibration instances of ``column`` (instances average their seeds)."""
    cal = runs[runs.kind == "calibration"]
    per = cal.groupby(["arm", "level", "instance"])[column].mean()
    return per.groupby(["arm", "level"]).mean().unstack("level")


def best_coef(row: pd.Series) -> float:
    """The coefficient with the highest value (ties: the smaller coefficient)."""
    row = row.dropna()
    return float(row[row == row.max()].index.min())


def interpolate(curve: pd.Series, x: float) -> float:
    """The value at coefficient ``x`` of ``curve`` (coefficient -> value), linear in log coefficient between the two
    adjacent calibration coefficients (x inside the calibrated range)."""
    c = curve.dropna().sort_index()
    return float(np.interp(math.log(x), np.log(c.index.to_numpy(float)), c.to_numpy(float)))


def choose_control(gold: pd.Series, coef: float, margin: float) -> tuple[float, bool]:
    """(control coefficient, interpolated): where ``gold`` (coefficient -> mean final gold of the reference arm),
    linear in log β between calibration coefficients, first differs from gold[coef] by ``margin``, searching the
    stronger side (β > coef) outward, then the weaker; else the other coefficient whose difference is closest to
    ``margin`` (ties: the smaller), not interpolated."""
    g = gold.dropna().sort_index()
    if len(g) < 2:
        raise ValueError("the positive control needs a second calibration coefficient with results")
    betas = list(g.index.astype(float))
    i = betas.index(coef)
    for side in (betas[i:], betas[: i + 1][::-1]):
        for a, b in itertools.pairwise(side):
            da, db = abs(g[a] - g[coef]), abs(g[b] - g[coef])
            if da < margin <= db:  # the curve crosses one margin between a and b: solve in log β
                t = (margin - da) / (db - da)
                return float(math.exp(math.log(a) + t * (math.log(b) - math.log(a)))), True
    others = g.drop(coef)
    dist = ((g[coef] - others).abs() - margin).abs()
    return float(dist[dist == dist.min()].index.min()), False


def acting_coef(gold: pd.Series, none_gold: float, margin: float, acts: float) -> tuple[float, bool]:
    """(coef, acts): the coefficient with the best gold among those where the no-KL contrast |none_gold - gold| is
    at least ``acts`` x ``margin`` (ties: the smaller); if none, the one with the largest contrast, and False."""
    contrast = (none_gold - gold.dropna()).abs()
    acting = gold[contrast >= acts * margin].dropna()
    if acting.empty:
        return float(contrast[contrast == contrast.max()].index.min()), False
    return best_coef(acting), True


def _sign(x: float) -> int:
    return 1 if x > 0 else -1 if x < 0 else 0


def calibrate(
    runs: pd.DataFrame,
    evals: pd.DataFrame,
    *,
    task: str,
    rules: CalibrationParams,
    reference_arm: str,
    arms: list[str],
    metrics: list[str],
) -> dict:
    """The protocol values of ``task`` from its calibration runs (module docstring). Returns a JSON-able dict."""
    pts = no_kl_points(runs, evals)
    if pts.empty:
        raise ValueError(f"task {task}: no calibration no-KL runs")
    inst = pts.groupby("instance").mean(numeric_only=True)
    gain = float((inst[f"{rules.gain}_gold"] - inst.sft_gold).mean())
    if not gain > 0:
        raise ValueError(f"task {task}: the no-KL runs gain no gold on calibration ({gain:.3g}): no margin scale")
    margin = rules.margin_fraction * gain
    gold = coef_table(runs, "final_gold")
    missing = [a for a in arms if a not in gold.index]
    if missing:
        raise ValueError(f"task {task}: no calibration runs of arm(s) {', '.join(missing)}")
    log_kl = coef_table(runs.assign(log_kl=np.log(runs.final_kl.clip(lower=1e-12))), "log_kl")
    ref_gold, ref_log_kl = gold.loc[reference_arm], log_kl.loc[reference_arm]
    base = runs[runs.kind == "calibration_baseline"]
    none_gold = float(_instance_mean(base, "final_gold").mean())
    none_log_kl = float(_instance_mean(base.assign(log_kl=np.log(base.final_kl.clip(lower=1e-12))), "log_kl").mean())
    best = {a: best_coef(gold.loc[a]) for a in arms}
    coef, acts = acting_coef(ref_gold, none_gold, margin, rules.acts)
    control, interpolated = choose_control(ref_gold, coef, margin)
    at = lambda curve, x: interpolate(curve, x) if interpolated else float(curve[x])
    control_effect = {"gold": float(ref_gold[coef]) - at(ref_gold, control),
                      "log_kl": float(ref_log_kl[coef]) - at(ref_log_kl, control)}  # fmt: skip
    log_kl_margin = rules.log_kl_fraction * abs(none_log_kl - float(ref_log_kl[coef]))
    if not log_kl_margin > 0:
        raise ValueError(f"task {task}: the reference arm leaves log KL where no KL has it: no log-KL margin")
    final_kl = float(pts.final_kl.median())
    return {
        "task": task,
        "calibration_instances": sorted(int(i) for i in pts.instance.unique()),
        "rules": rules.model_dump(),
        "no_kl": {
            "sft_gold": float(inst.sft_gold.mean()),
            "peak_gold": float(inst.peak_gold.mean()),
            "final_gold": float(inst.final_gold.mean()),
            "final_log_kl": none_log_kl,
            "peak_kl": [float(x) for x in pts.peak_kl],
            "final_kl": [float(x) for x in pts.final_kl],
            "peak_iteration": [int(x) for x in pts.peak_iteration],
            "gain": gain,
        },
        "margins": {**{m: margin for m in metrics}, "log_kl": log_kl_margin},
        "levels": [f * final_kl for f in rules.levels],
        "coef": coef,
        "acts_on_calibration": acts,
        "no_kl_contrast": {f"{c:g}": _num(none_gold - v) for c, v in ref_gold.items()},
        "tuned": best,
        "control_coef": control,
        "control_interpolated": interpolated,
        "control_effect": control_effect,
        "control_direction": {k: _sign(v) for k, v in control_effect.items()},
        "no_kl_direction": {
            "gold": _sign(none_gold - float(ref_gold[coef])),
            "log_kl": _sign(none_log_kl - float(ref_log_kl[coef])),
        },
        "calibration_gold": {a: {f"{c:g}": _num(v) for c, v in gold.loc[a].items()} for a in arms},
        "calibration_log_kl": {a: {f"{c:g}": _num(v) for c, v in log_kl.loc[a].items()} for a in arms},
    }


def _num(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)
